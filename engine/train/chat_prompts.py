"""The chat prompts: the hand-written bench and held-out sets, and the templated training prompts a chat
drafter is distilled on.

Training prompts are built from topic lists crossed with question forms, plus prompts derived offline
from the Python standard library (module docstrings). None of them is a bench or held-out prompt, and
none touches a held-out prompt's subject (`HELDOUT_SUBJECTS`), so held-out acceptance measures
generalisation, not recall.
"""
from __future__ import annotations

import json
import random
import re
import sys
from functools import lru_cache

from engine.sources import ASSETS

CHAT_PROMPTS = ASSETS / "prompts" / "chat.json"
SETS = ("bench", "heldout", "fresh", "wide")

# Word stems that mark a held-out prompt's subject; no training prompt may hold a word that begins with one.
# The first line's are the 16 'heldout' prompts'; the rest are the 48 'wide' prompts', chosen on 2026-12-05
# among stems no prompt of any shipped pack, nor any templated prompt, had touched.
HELDOUT_SUBJECTS = ("airplane", "aeroplane", "aircraft", "api", "limerick", "climate", "egg", "virus",
                    "bacteri", "sleep", "bicycle", "gears", "grocer", "photosynth", "internet", "formal",
                    "australia", "sydney", "canberra", "guitar", "recycl", "javascript",
                    "dinosaur", "escalator", "cactus", "tulip", "pension", "flamingo", "giraffe", "jellyfish",
                    "walrus", "sloth", "badminton", "trampoline", "igloo", "windmill", "accordion", "saxophone",
                    "clarinet", "metronome", "pendulum", "sundial", "abacus", "barometer", "dishwasher", "stapler",
                    "zipper", "velcro", "typewriter", "telegraph", "zeppelin", "glider", "monorail", "ferry",
                    "kayak", "mosquito", "earthworm", "peacock", "hummingbird", "woodpecker", "equinox", "pulsar",
                    "stalactite", "quicksand", "tundra", "savanna", "fjord", "sudoku", "rubik", "snowman",
                    "trumpet")


@lru_cache(maxsize=1)
def _chat_file() -> dict:
    return json.loads(CHAT_PROMPTS.read_text())


def chat_prompts(which: str) -> list[str]:
    """The hand-written chat prompts: 'bench' (32), 'heldout' (16, never trained on), 'fresh' (12, written
    after the EAGLE-3-style head's data, never trained on nor used for a choice) or 'wide' (48 on held-out
    subjects, written after every pack, never trained on: enough to tell two heads apart by a point or two)."""
    if which not in SETS:
        raise ValueError(f"chat prompt set must be one of {SETS}, not {which!r}")
    return list(_chat_file()[which])


CONCEPTS = (
    "gravity", "magnetism", "static electricity", "friction", "evaporation", "the speed of light", "atoms",
    "DNA", "evolution by natural selection", "the immune system", "volcanoes", "earthquakes", "rainbows",
    "the phases of the moon", "ocean tides", "the greenhouse effect on Venus", "sound waves", "electric current",
    "chemical reactions", "the periodic table", "black holes", "the Big Bang", "plate tectonics", "fossils",
    "the human heart", "muscles", "the nervous system", "vitamins", "probability", "prime numbers",
    "fractions", "algebra", "the number pi", "statistics", "compound interest", "supply and demand",
    "taxes", "democracy", "the scientific method", "renewable energy", "nuclear power", "batteries",
    "magnets in motors", "solar panels", "the water table", "glaciers", "deserts", "rainforests",
    "coral reefs", "bees and pollination", "migration of birds", "hibernation", "the food chain",
    "encryption", "binary numbers", "operating systems", "databases", "cloud computing", "version control",
    "open source software", "artificial intelligence", "neural networks", "search engines",
    "computer memory", "recursion", "sorting algorithms", "object-oriented programming", "unit testing",
    "the stock exchange", "credit scores", "mortgages", "budgeting", "opportunity cost", "marketing",
    "leadership", "teamwork", "critical thinking", "memory and learning", "habits", "stress",
    "meditation", "nutrition", "hydration", "exercise and the heart", "first aid", "the five senses",
    "optical illusions", "color mixing", "perspective in drawing", "music scales", "rhythm",
    "poetry meter", "metaphors", "the novel as a form", "mythology", "philosophy", "ethics", "logic",
    "language families", "dialects", "etiquette", "time zones", "maps and projections", "latitude",
    "the solar system", "Mars", "Jupiter", "comets", "satellites", "the International Space Station",
    "telescopes", "microscopes", "thermometers", "clocks", "the printing press", "the steam engine",
    "electric cars", "trains", "bridges", "skyscrapers", "concrete", "glass making", "paper",
)
CONCEPT_FORMS = (
    "What is {t}?", "Explain {t} in simple terms.", "How would you explain {t} to a ten-year-old?",
    "Give me three interesting facts about {t}.", "Why does {t} matter?", "Write a short paragraph about {t}.",
    "What are common misconceptions about {t}?", "Explain {t} using an everyday analogy.",
    "Write three quiz questions about {t}, with answers.", "What should a beginner know about {t}?",
)

SKILLS = (
    "bake bread at home", "change a flat tire", "start running", "write a good resume", "plant tomatoes",
    "learn a new language", "take better photos with a phone", "make a budget", "organize my desk",
    "write a cover letter", "prepare for an exam", "give a good presentation", "paint a room",
    "care for a houseplant", "make pancakes", "brew good coffee", "start a vegetable garden",
    "learn to swim as an adult", "write a short story", "negotiate a salary", "clean a laptop keyboard",
    "fold a shirt neatly", "tie a tie", "build a birdhouse", "train a puppy", "make friends in a new city",
    "read faster", "keep a journal", "learn to draw", "back up my files", "set up a home network",
    "write clean code", "debug a program", "learn touch typing", "plan a road trip", "cook rice",
    "make a smoothie", "start a podcast", "reduce screen time", "stretch after a workout",
)
SKILL_FORMS = (
    "How do I {s}?", "Give me step-by-step instructions to {s}.", "What are common mistakes when trying to {s}?",
    "What do I need to {s}?", "I want to {s}. Where should I start?",
)

PLACES_AND_PEOPLE = (
    "Marie Curie", "Isaac Newton", "Albert Einstein", "Ada Lovelace", "Leonardo da Vinci", "Cleopatra",
    "Julius Caesar", "Galileo Galilei", "Charles Darwin", "Nelson Mandela", "Mahatma Gandhi",
    "William Shakespeare", "Jane Austen", "Mozart", "Beethoven", "Frida Kahlo", "Alan Turing",
    "Grace Hopper", "the Great Wall of China", "ancient Egypt", "the Roman aqueducts", "the Renaissance",
    "the Industrial Revolution", "the Silk Road", "the Maya civilisation", "the Vikings", "Machu Picchu",
    "the Eiffel Tower", "the Amazon river", "Mount Everest", "the Sahara", "Antarctica", "Japan", "Brazil",
    "Canada", "Kenya", "Norway", "India", "the Mediterranean Sea", "the moon landing",
)
PLACE_FORMS = (
    "Tell me about {x}.", "Why is {x} important?", "What are three things most people do not know about {x}?",
    "Write a short summary of {x} for a history class.",
)

CREATIVE_SUBJECTS = (
    "autumn leaves", "a robot learning to paint", "the ocean at night", "a busy train station",
    "a lost umbrella", "the first snow of winter", "a dragon who is afraid of fire", "an old library",
    "a city in the year 3000", "a friendly ghost", "a kitten's first day outside", "a mountain village",
    "the smell of fresh bread", "a sunrise over the sea", "a detective who is a dog", "a time traveller",
    "a garden in spring", "a spaceship's last voyage", "a letter never sent", "a quiet Sunday morning",
    "a lighthouse in a storm", "a magical forest", "an inventor's workshop", "a school play",
    "a thunderstorm", "the last day of summer", "a river's journey", "a street musician",
)
CREATIVE_FORMS = (
    "Write a short poem about {x}.", "Write a haiku about {x}.", "Write a very short story about {x}.",
    "Describe {x} in vivid detail.", "Write the opening paragraph of a novel about {x}.",
)

CODE_TASKS = (
    "sorts a list of numbers", "counts the words in a sentence", "checks whether a number is prime",
    "merges two dictionaries", "finds the largest element in a list", "computes the factorial of n",
    "returns the n-th Fibonacci number", "removes duplicates from a list", "reads a CSV file",
    "converts Celsius to Fahrenheit", "checks whether two words are anagrams", "flattens a nested list",
    "counts the vowels in a string", "finds the average of a list", "validates an email address",
    "capitalizes every word in a sentence", "computes the greatest common divisor", "transposes a matrix",
    "generates a random password", "finds the second largest number", "checks for balanced parentheses",
    "implements binary search", "implements a stack", "implements a queue", "counts character frequencies",
    "rotates a list by k positions", "checks whether a year is a leap year", "converts a number to binary",
    "sums the digits of a number", "finds common elements of two lists",
)
CODE_FORMS = (
    "Write a Python function that {c}.", "How would you write a function in Python that {c}?",
    "Write a C function that {c}.", "Explain how to write code that {c}, and give an example.",
)

PAIRS = (
    ("a lake", "a pond"), ("weather", "climate in a city"), ("a noun", "a verb"), ("speed", "velocity"),
    ("mass", "weight"), ("an atom", "a molecule"), ("a comet", "an asteroid"), ("a crocodile", "an alligator"),
    ("a frog", "a toad"), ("RAM", "storage"), ("HTTP", "HTTPS"), ("a compiler", "an interpreter"),
    ("Python", "C"), ("a list", "a set in Python"), ("a loan", "a grant"), ("saving", "investing"),
    ("a simile", "a metaphor"), ("a tsunami", "a tidal wave"), ("a hurricane", "a tornado"),
    ("a democracy", "a monarchy"), ("a violin", "a viola"), ("baking soda", "baking powder"),
    ("an ocean", "a sea"), ("a planet", "a star"), ("a meteor", "a meteorite"), ("a bug", "a feature"),
    ("TCP", "UDP"), ("an algorithm", "a program"), ("stocks", "bonds"), ("a rabbit", "a hare"),
)
PAIR_FORMS = ("What is the difference between {a} and {b}?", "Compare {a} and {b} in a short table.")

SENTENCES = (
    "me and him goes to the store every days", "the meeting have been moved to tomorrow morning",
    "i think that we should probably maybe consider to start the project soon",
    "this are the best pizza i ever eaten", "Please kindly do the needful and revert back at the earliest.",
    "The results was not what we expected but they was interesting.",
    "our team worked very very hard on this and it is very good",
    "The cat sat on the mat and the cat was happy and the cat purred.",
    "Due to the fact that it was raining, we made the decision to stay inside.",
    "Their going to there house after they finish they're homework.",
    "The report, which was written by John, who works in sales, was long.",
    "In my personal opinion I believe that the movie was kind of good.",
    "We need to circle back and touch base about the deliverables going forward.",
    "the weather is nice today lets go outside and play",
    "Your order has been shipped and it will arrive soon hopefully.",
)
SENTENCE_FORMS = (
    "Rewrite this sentence to be clearer: {s}", "Fix the grammar in this sentence: {s}",
    "Make this sentence shorter: {s}", "Rewrite this in a friendly tone: {s}",
)

LISTS = (
    "famous painters", "kinds of clouds", "musical instruments", "board games for families", "healthy snacks",
    "programming languages", "ways to relax after work", "countries in Africa", "types of trees",
    "inventions from the 20th century", "ocean animals", "sports played with a ball", "kinds of pasta",
    "famous novels", "careers in science", "indoor hobbies", "ways to be kind to others", "planets",
    "fruits that are high in vitamin C", "tips for writing clearly", "reasons to learn history",
)
LIST_FORMS = ("List five {x}.", "Name three {x} and say one thing about each.")


def _templated() -> list[str]:
    out = [f.format(t=t) for t in CONCEPTS for f in CONCEPT_FORMS]
    out += [f.format(s=s) for s in SKILLS for f in SKILL_FORMS]
    out += [f.format(x=x) for x in PLACES_AND_PEOPLE for f in PLACE_FORMS]
    out += [f.format(x=x) for x in CREATIVE_SUBJECTS for f in CREATIVE_FORMS]
    out += [f.format(c=c) for c in CODE_TASKS for f in CODE_FORMS]
    out += [f.format(a=a, b=b) for a, b in PAIRS for f in PAIR_FORMS]
    out += [f.format(s=s) for s in SENTENCES for f in SENTENCE_FORMS]
    out += [f.format(x=x) for x in LISTS for f in LIST_FORMS]
    return out


def _stdlib_prompts() -> list[str]:
    """Two prompts per documented standard-library module: what it is for, and an example of its use."""
    import importlib

    out = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo"}:
            continue
        try:
            module = importlib.import_module(name)
        except Exception:  # platform-specific or deprecated modules
            continue
        doc = (module.__doc__ or "").strip().splitlines()
        if not doc or len(doc[0]) < 12:
            continue
        out.append(f"What is the Python module `{name}` used for? Its documentation begins: \"{doc[0]}\"")
        out.append(f"Show a short example of using Python's `{name}` module and explain it.")
    return out


# a word (a run of letters a-z) that begins with a stem: the stem, not preceded by a letter
_HELDOUT_WORD = re.compile(r"(?<![a-z])(?:" + "|".join(map(re.escape, HELDOUT_SUBJECTS)) + ")")


def touches_heldout_subject(text: str) -> bool:
    """Whether a word of `text` begins with a held-out subject's stem: such a text is never trained on."""
    return _HELDOUT_WORD.search(text.lower()) is not None


def training_prompts(seed: int = 0) -> list[str]:
    """Every training prompt, deduplicated and shuffled with `seed`: no bench or held-out prompt, and no
    held-out subject."""
    reserved = {p.strip().lower() for which in SETS for p in chat_prompts(which)}
    seen, out = set(), []
    for prompt in _templated() + _stdlib_prompts():
        key = prompt.strip().lower()
        if key in seen or key in reserved or touches_heldout_subject(prompt):
            continue
        seen.add(key)
        out.append(prompt)
    random.Random(seed).shuffle(out)
    return out


# How people begin a chat turn: a steered Magpie run (`draft-data --steered`) starts each sampled user turn
# with one of these and lets the target finish it. Free Magpie turns from SmolLM2 mostly begin "I'm ..." or
# "Can you ..." (4,300 of 5,783 in the second data folder) and almost never ask for code, verse, lists or
# rewrites, which people do ask for. Forms only: no subject, and none touches a held-out subject.
OPENERS = (
    "How do", "How does", "How do I", "How can I", "How to", "Why do", "Why does", "Why is", "Why are",
    "What is", "What are", "What is the difference between", "What happens when", "What should I",
    "Explain", "Explain how", "Explain why", "Explain to a beginner", "Write a", "Write a short", "Write a poem",
    "Write a story", "Write a Python function that", "Write a function", "Write an email", "Write a letter",
    "List", "List three", "Give me", "Give me a plan", "Give me tips", "Describe", "Describe how", "Summarise",
    "Summarize", "Rewrite this", "Fix the grammar", "Compare", "Tell me about", "Tell me a", "Can you explain",
    "Can you help me", "Suggest", "Is it true that", "Should I", "When did", "Who was", "Which", "Create a",
    "Help me", "Teach me", "I need",
)
