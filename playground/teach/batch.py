"""The batch lesson: what a goodput study (engine.bench.batch.BatchStudy) says, in sentences whose every
number is read from the study itself. Nothing here measures or draws."""
from __future__ import annotations

from engine.bench.batch import BatchStudy


def _x(value: float) -> str:
    return f"{value:.2f}×"


def batch_lesson(study: BatchStudy) -> list[str]:
    """Paragraphs (Markdown) for the batch view, in teaching order: a batch shares the weights' reads, the
    verify's rows multiply with B, where speculation stops paying, how the best K moves, what drafting costs."""
    sizes = study.batches
    small, large = sizes[0], sizes[-1]
    one, many = study.point(small, "target"), study.point(large, "target")
    out = []
    if large > small:
        out.append(
            f"**A batch shares the weights.** Target-only, {small} sequence{'s' if small > 1 else ''} decoded at "
            f"{one.tokens_per_s:.1f} tokens/s; {large} at once decoded at {many.tokens_per_s:.1f} tokens/s in all, "
            f"{_x(many.tokens_per_s / one.tokens_per_s)} as fast. Each round reads every matrix once for all the "
            f"sequences: the forward over {large} rows took {many.forward_ms:.1f} ms against {one.forward_ms:.1f} ms "
            f"for {small} ({_x(many.forward_ms / one.forward_ms)} the time for {large // small}× the rows).")
    best_small = study.best_speculative(small)
    if best_small is not None:
        out.append(
            f"**Speculation spends the same spare room.** At B = {small} the best method, {best_small.method}, ran "
            f"{_x(best_small.speedup)} target-only: its verify fed {best_small.rows_per_sequence:.1f} rows per "
            f"sequence at {_x(best_small.r)} the cost of target-only's forward, and α was "
            f"{best_small.alpha:.2f}.")
    best_large = study.best_speculative(large)
    if best_large is not None and large > small:
        rows = best_large.rows_per_sequence * large
        out.append(
            f"**At B = {large} a verify is no longer cheap.** The best method there, {best_large.method}, fed "
            f"{rows:.0f} rows a round ({large} sequences × {best_large.rows_per_sequence:.1f}); that forward cost "
            f"{_x(best_large.r)} target-only's {large}-row forward, and it ran {_x(best_large.speedup)} "
            "target-only.")
    for method in study.methods():
        if method == "target":
            continue
        measured, predicted = study.crossover(method), study.crossover(method, predicted=True)
        if measured is None and predicted is None:
            out.append(f"**{method}** paid at every batch size measured (up to {large}), and the prediction "
                       "agrees.")
            continue
        said = f"stops paying at B = {measured}" if measured is not None else \
            f"paid at every batch size measured (up to {large})"
        guess = f"B = {predicted}" if predicted is not None else f"no batch size up to {large}"
        out.append(f"**{method}** {said}; Leviathan's formula, fed the measured α, r_B(n), draft time and the rest "
                   f"of a round, says {guess}.")
    for drafter in dict.fromkeys(b.drafter for b in study.best_k):
        ks = [b for b in study.best_k if b.drafter == drafter]
        first, last = ks[0], ks[-1]
        move = "stays at" if first.predicted_k == last.predicted_k else "moves from"
        tail = f"K = {first.predicted_k}" if move == "stays at" else \
            f"K = {first.predicted_k} at B = {first.batch} to K = {last.predicted_k} at B = {last.batch}"
        measured = ", ".join(f"B = {b.batch}: K = {b.measured_k}" for b in ks if b.measured_k is not None)
        out.append(f"**K per batch size ({drafter}).** The K that maximises the predicted goodput {move} {tail} "
                   f"(the best K measured among those run: {measured}).")
    if best_large is not None and best_large.wall_tokens_per_s and many.wall_tokens_per_s:
        out.append(
            f"**A static batch waits for its slowest sequence.** The figures above are the steady state (rounds "
            f"every sequence decoded in). Over whole runs, the prefill and the tail after the first sequence "
            f"finished included, {best_large.method} at B = {large} made {best_large.wall_tokens_per_s:.1f} tokens/s "
            f"against target-only's {many.wall_tokens_per_s:.1f} "
            f"({_x(best_large.wall_tokens_per_s / many.wall_tokens_per_s)}): speculation makes sequences finish "
            "unevenly, and a server that refills its batch as sequences finish keeps the steady state.")
    drafted = [p for p in study.points if p.drafter not in ("none", "ngram")]
    if drafted and large > small:
        method = drafted[0].method
        d1, dn = study.point(small, method), study.point(large, method)
        out.append(f"**Drafting grows with B too.** {method} spent {d1.draft_ms:.1f} ms drafting a round at "
                   f"B = {small} and {dn.draft_ms:.1f} ms at B = {large}: each draft step is one forward for every "
                   "sequence, but the drafter's attention (each sequence's own cache), the sampling and the bookkeeping are per sequence.")
    return out
