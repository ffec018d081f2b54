"""The pipeline schedules' action tables (msjax.parallel.schedules): every table is a legal execution of one flush
(each pass once, after what it needs, one pass per stage per tick), and its idle time and activations in flight
are the closed forms of Narayanan et al. 2021 and Qi et al. 2024."""

import itertools

import pytest

from msjax.parallel.schedule import bubble_fraction
from msjax.parallel.schedules import SCHEDULES, Action, ActionTable, paper_bubble, paper_idle

CASES = {
    "1f1b": [(p, 1, m) for p, m in itertools.product((2, 3, 4, 8), (1, 2, 4, 8, 13, 64))],
    "interleaved": [(p, v, m) for p, v, m in itertools.product((2, 4, 8), (1, 2, 3), (8, 16, 64))],
    "zb-h1": [(p, 1, m) for p, m in itertools.product((2, 3, 4, 8), (1, 2, 4, 8, 13, 64))],
    "zb-v": [(p, 2, m) for p, m in itertools.product((2, 3, 4, 8), (1, 2, 4, 8, 13, 16, 64))],
}


def _legal(table: ActionTable) -> None:
    """Each F, B, W of every (microbatch, virtual stage) exactly once, on the stage holding it, strictly after the
    passes it needs (a B after the B of the next virtual stage, and, without the split, after its W too)."""
    seen = {}
    for p, row in enumerate(table.grid):
        for t, a in enumerate(row):
            if a is None:
                continue
            assert a not in seen, f"{a} twice"
            assert table.stage_of(a.virtual_stage) == p, (a, p)
            seen[a] = t
    want = {Action(k, i, s) for k in "FBW" for i in range(table.microbatches) for s in range(table.virtual)}
    assert set(seen) == want
    split = table.name.startswith("zb")
    for a, t in seen.items():
        i, s = a.microbatch, a.virtual_stage
        needs = {"F": [("F", i, s - 1)] if s else [],
                 "B": [("F", i, s)] + ([("B" if split else "W", i, s + 1)] if s < table.virtual - 1 else []),
                 "W": [("B", i, s)]}[a.kind]
        for need in needs:
            assert seen[Action(*need)] < t, (a, need)


@pytest.mark.parametrize("name, p, v, m", [(n, *c) for n, cases in CASES.items() for c in cases])
def test_tables_are_legal_flushes_with_the_closed_form_bubble(name, p, v, m):
    table = ActionTable(name, p, v, m)
    _legal(table)
    assert table.ticks * 1 == table.work + table.idle and table.work == 3 * v * m
    # the closed forms hold once the pipeline has a steady state: M >= P (zb-v: M >= 2P, its V has 2P stages)
    if m >= (2 * p if name == "zb-v" else p):
        assert table.idle == paper_idle(name, p, v, m), table.text()
        assert table.bubble == pytest.approx(paper_bubble(name, p, v, m), abs=1e-12)
    if name in ("1f1b", "interleaved"):
        # msjax's long-standing formula (P - 1) / (V M + P - 1), the planner's until now
        assert table.bubble == pytest.approx(bubble_fraction(p, v, m), abs=1e-12)
    if name in ("1f1b", "zb-h1"):  # 1F1B's activations in flight, ZB-H1's too: min(M, P - p) on stage p
        assert [table.in_flight(s) for s in range(p)] == [min(m, p - s) for s in range(p)]
    if name == "zb-h1":
        assert max(table.awaiting_w(s) for s in range(p)) <= p
    if name == "zb-v":  # 1F1B's stage-0 peak (P whole microbatches = 2P chunk-microbatches), on every stage
        assert max(table.in_flight(s) for s in range(p)) <= 2 * p


def test_zero_bubble_tables_have_a_third_or_less_of_1f1b_idle_time():
    """The paper's headline: ZB-H1's bubble is a third of 1F1B's at 1F1B's activations; ZB-V's is a third of
    ZB-H1's again in whole-stage time (its passes are half a stage each)."""
    for p, m in ((4, 8), (8, 64)):
        one, h1, v = (ActionTable(n, p, vv, m) for n, vv in (("1f1b", 1), ("zb-h1", 1), ("zb-v", 2)))
        assert h1.idle * 3 == one.idle and v.idle == h1.idle and v.bubble < h1.bubble < one.bubble


def test_grid_text():
    table = ActionTable("zb-h1", 4, 1, 8)
    text = table.text()
    head, *rows = text.splitlines()
    assert head == "zb-h1: P=4 V=1 M=8, 27 ticks of one pass each, idle 3 per stage, bubble 11.1%"
    assert len(rows) == 4 and rows[0].startswith("stage 0  | F0 F1 F2 F3 .  .  .  B0 F4") and rows[3].endswith("W7")
    # the second chunk of a stage is written in lower case, and long rows are cut at `width`
    v = ActionTable("zb-v", 2, 2, 4).text().splitlines()
    assert "f0" in v[1] and "b0" in v[2] and "w3" in v[1]
    assert all(len(line) <= 60 for line in ActionTable("zb-v", 8, 2, 64).text(width=60).splitlines()[1:])


@pytest.mark.parametrize("name, p, v, m, message", [
    ("zb-h2", 4, 1, 8, "pipeline schedule 'zb-h2': allowed are " + ", ".join(SCHEDULES)),
    ("zb-h1", 4, 2, 8, "zb-h1 runs one chunk per stage: pipeline.virtual_stages=1, got 2"),
    ("1f1b", 4, 3, 8, "1f1b runs one chunk per stage"),
    ("zb-v", 4, 1, 8, "zb-v runs two chunks per stage: pipeline.virtual_stages=2, got 1"),
    ("interleaved", 4, 2, 6, "M=6 microbatches must be a multiple of P=4 stages"),
    ("1f1b", 0, 1, 8, "P, V, M >= 1, got P=0"),
])
def test_bad_schedules_are_refused(name, p, v, m, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ActionTable(name, p, v, m)


@pytest.mark.parametrize("name, p, v, m", [("1f1b", 4, 1, 8), ("zb-h1", 4, 1, 8), ("zb-h1", 3, 1, 2),
                                           ("zb-v", 2, 2, 4), ("zb-v", 4, 2, 8), ("zb-v", 3, 2, 5)])
def test_compiled_tables_route_every_input_to_the_pass_that_reads_it(name, p, v, m):
    """The step's integer tables (zero_bubble.compile_table), run as the step runs them on stand-in values: each
    pass reads, from its inbox, stash and W slots, exactly the value the pass it depends on wrote there (no slot
    reused while its value is still to be read); sends go on the ring to the right neighbour."""
    from msjax.parallel.zero_bubble import BWD, FWD, KEEP, NEXT, PREV, WGT, compile_table

    table = ActionTable(name, p, v, m)
    plan = compile_table(table)
    inbox = [[None] * (plan.inbox_slots + 1) for _ in range(p)]
    stash = [[None] * (plan.res_slots + 1) for _ in range(p)]
    wstash = [[None] * (plan.w_slots + 1) for _ in range(p)]
    for t in range(table.ticks):
        out = [None] * p
        for q in range(p):
            a = table.grid[q][t]
            kind = plan.kind[q, t]
            assert kind == {None: 0, "F": FWD, "B": BWD, "W": WGT}[a and a.kind]
            if a is None:
                continue
            i, s = a.microbatch, a.virtual_stage
            if a.kind == "F":
                if s:
                    assert inbox[q][plan.inbox[q, t]] == ("F", i, s - 1), (a, t)
                stash[q][plan.res[q, t]] = ("F", i, s)
            elif a.kind == "B":
                want = ("B", i, s + 1) if s < table.virtual - 1 else ("loss", i)
                assert inbox[q][plan.inbox[q, t]] == want, (a, t)
                assert stash[q][plan.res[q, t]] == ("F", i, s), (a, t)
                wstash[q][plan.wslot[q, t]] = ("B", i, s)
            else:
                assert wstash[q][plan.wslot[q, t]] == ("B", i, s), (a, t)
            out[q] = (a.kind, i, s)
        for q in range(p):  # the end of the tick: what arrives on each ring, what is kept, the loss gradient
            ways = {NEXT: (q + 1) % p, PREV: (q - 1) % p, KEEP: q}
            if out[q] is not None and plan.route[q, t] in ways:
                dst = ways[plan.route[q, t]]
                name_ = {NEXT: plan.from_prev, PREV: plan.from_next, KEEP: plan.keep}[plan.route[q, t]]
                if p == 2 and plan.route[q, t] == PREV:  # on two stages both rings join the same pair
                    name_ = plan.from_next
                inbox[dst][name_[dst, t]] = out[q]
                assert plan.send_next[t] or plan.route[q, t] != NEXT
                assert plan.send_prev[t] or plan.route[q, t] != PREV
        if plan.loss_on[t]:
            inbox[plan.host][plan.loss[plan.host, t]] = ("loss", int(plan.loss_mb[t]))
