"""`python -m engine <command>`: generate, bench, peer-bench, cache-bench, train-builtin, eval-builtin, train-draft,
draft-data, train-eagle3, eval-eagle3, sampled-bench, calibrate, watch, audit, serve."""
import sys


def main() -> int:
    commands = {
        "generate": "engine.cli",
        "bench": "engine.bench.cli",
        "peer-bench": "engine.bench.peer",
        "train-builtin": "engine.train.builtin",
        "eval-builtin": "engine.train.builtin_eval",
        "train-draft": "engine.train.draft",
        "draft-data": "engine.train.eagle3_data",
        "train-eagle3": "engine.train.eagle3",
        "eval-eagle3": "engine.train.eagle3_eval",
        "cache-bench": "engine.bench.cache_bench",
        "calibrate": "engine.bench.formats",
        "sampled-bench": "engine.bench.sampled",
        "watch": "engine.watch",
        "audit": ("engine.audit.cli", "audit_main"),
        "serve": ("engine.audit.cli", "serve_main"),
    }
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        print(f"usage: python -m engine {{{','.join(commands)}}} [options]  (--help on each)", file=sys.stderr)
        return 2
    import importlib

    module, function = commands[sys.argv[1]] if isinstance(commands[sys.argv[1]], tuple) \
        else (commands[sys.argv[1]], "main")
    return getattr(importlib.import_module(module), function)(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
