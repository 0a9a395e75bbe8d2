"""Session affinity for the HTTP router (serving.fleet.affinity): a fleet whose requests all share
their first blocks spreads; conversations and session ids stick; outstanding work balances; state
is bounded."""

import collections
import math

import pytest

from serving.fleet.affinity import Affinity

BACKENDS = ["b0", "b1", "b2"]
SYSTEM = list(range(1000, 1512))  # 512 shared tokens: 8 blocks of 64, the old session key's whole window


def conversations(n, turns, seed=0):
    """``n`` conversations of ``turns`` prompts each, every prompt starting with SYSTEM; each turn
    extends the previous prompt by an answer and a user message."""
    out = []
    for i in range(n):
        p = SYSTEM + [i % 250, i // 250, 7, 7, 7]
        convo = [p]
        for t in range(1, turns):
            p = p + [(i * 31 + t * 7 + k) % 256 for k in range(40)]
            convo.append(p)
        out.append(convo)
    return out


def test_shared_prefix_trace_spreads_and_conversations_stick():
    a = Affinity(BACKENDS)
    convs = conversations(90, 3)
    # The old key (a hash of the first 512 tokens) is one session for the whole trace.
    assert len({tuple(c[0][:512]) for c in convs}) == 1
    placed = collections.defaultdict(set)
    for t in range(3):  # turns interleaved across conversations, as a trace replays them
        for i, c in enumerate(convs):
            s, blocks = a.prompt_key(c[t])
            placed[i].add((s, a.route(s, cost=len(c[t]) + 16, blocks=blocks)))
    assert all(len(v) == 1 for v in placed.values()), "every turn of a conversation: one session, one backend"
    per_backend = collections.Counter(b for v in placed.values() for _, b in v)
    cap = math.ceil(1.25 * 90 / 3)
    assert set(per_backend) == set(BACKENDS) and max(per_backend.values()) <= cap
    assert min(per_backend.values()) >= 90 - 2 * cap


def test_new_sessions_prefer_backends_with_their_prefix():
    # Loose bounds: every conversation sharing a document goes where the document was sent.
    a = Affinity(BACKENDS, c=100.0)
    doc = list(range(2000, 2000 + 640))
    homes = set()
    for i in range(20):
        s, blocks = a.prompt_key(doc + [i, i, i])
        homes.add(a.route(s, blocks=blocks))
    assert len(homes) == 1
    # Unrelated prompts still go by their rendezvous ranking.
    others = set()
    for i in range(30):
        s, blocks = a.prompt_key([i + 7, 3] * 50)
        others.add(a.route(s, blocks=blocks))
        assert others <= set(BACKENDS)
    assert len(others) == 3


def test_session_ids_stick_and_work_balances():
    a = Affinity(BACKENDS)
    first = {f"user{i}": a.route(f"user{i}", explicit=True, cost=100) for i in range(30)}
    # Outstanding work piles up on one backend: explicit sessions stay, new sessions avoid it.
    busy = "b1"
    for _ in range(20):
        a.begin(busy, 1000)
    for s, b in first.items():
        assert a.route(s, explicit=True, cost=100) == b
    fresh = [a.route(f"new{i}", cost=100) for i in range(30)]
    assert busy not in fresh
    for _ in range(20):
        a.end(busy, 1000)
    assert all(v == 0 for v in a.work.values()) and all(v == 0 for v in a.inflight.values())
    # Derived sessions leave an overloaded backend: one identical prompt from many clients spreads.
    a = Affinity(BACKENDS)
    s = a.prompt_session([5] * 100)
    seen = []
    for _ in range(24):
        assert a.prompt_session([5] * 100) == s
        b = a.route(s, cost=100)
        a.begin(b, 100)
        seen.append(b)
    assert len(set(seen)) == 3 and a.moved_for_load >= 2 and max(collections.Counter(seen).values()) <= 12
    for b in seen:
        a.end(b, 100)
    assert all(v == 0 for v in a.work.values()) and all(v == 0 for v in a.inflight.values())


def test_continuations_branches_and_text_prompts():
    a = Affinity(BACKENDS)
    warm = "You are a careful assistant. " * 10
    s0 = a.prompt_session(warm)  # e.g. a prefix warm-up request
    first = a.prompt_session(warm + "Q: what is KDA?")
    assert first == s0  # the first prompt to extend it continues it
    others = {a.prompt_session(warm + f"Q: question {i}?") for i in range(10)}
    assert len(others) == 10 and s0 not in others  # later ones branch: new sessions
    # The conversation that continued goes on in its session; a regenerated prompt is the same one.
    nxt = warm + "Q: what is KDA?" + " A: a gated delta rule. Q: and MLA?"
    assert a.prompt_session(nxt) == first and a.prompt_session(nxt) == first
    # Token ids and text are separate spaces; a batch of prompts is its JSON text.
    assert a.prompt_session([1, 2, 3]) != a.prompt_session("[1, 2, 3]")
    assert a.prompt_session(["a", "b"]) == a.prompt_session(["a", "b"])


def test_failover_moves_to_next_choice_without_flapping():
    a = Affinity(BACKENDS, c=10.0)
    sessions = [f"s{i}" for i in range(30)]
    home = {s: a.route(s, explicit=True) for s in sessions}
    assert all(home[s] == a.ranking(s)[0] for s in sessions)
    a.fail("b0")
    moved = {s: a.route(s, explicit=True) for s in sessions if home[s] == "b0"}
    assert moved and all(b == a.ranking(s)[1] for s, b in moved.items())
    a.recover("b0")
    assert all(a.route(s, explicit=True) == b for s, b in moved.items())
    a.fail("b1")
    a.fail("b2")
    a.fail("b0")
    with pytest.raises(RuntimeError):
        a.route("x")


def test_state_is_bounded_by_size_and_age():
    now = [0.0]
    a = Affinity(BACKENDS, max_sessions=50, max_prompts=40, ttl_s=100.0, clock=lambda: now[0])
    for i in range(500):
        a.route(f"s{i}", explicit=True)
        a.prompt_session([i % 256, i // 256] * 40)
    assert len(a.sessions) == 50 and sum(a.count.values()) == 50
    assert a.num_prompts == 40 and sum(len(s.entries) for s in a.prompts.values()) == 40
    assert "s499" in a.sessions and "s0" not in a.sessions  # least recently used go first
    now[0] = 50.0
    a.route("s499", explicit=True)  # used again: kept past the others' age
    now[0] = 120.0
    a.route("late", explicit=True)
    assert set(a.sessions) == {"s499", "late"} and sum(a.count.values()) == 2
    a.prompt_session("fresh")
    assert a.num_prompts == 1
    # Many prompts under one last block (short tails after a shared system prompt) stay bounded too.
    for i in range(3000):
        a.prompt_session(SYSTEM + [i % 256, i // 256])
    assert a.num_prompts <= 40
