import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime_sim.plan import KNOWN_DIMS, contiguous_buffer_bytes
from runtime_sim.simulate import (
    PAGE, STRATEGIES, AddressSpace, SimConfig, make_ram, make_trace, parse_free, plot, simulate, to_json,
)
from toolkit.block_pool import BlockPool
from toolkit.errors import SpecError

SMOL = KNOWN_DIMS["smollm2"]


@pytest.fixture(scope="module")
def default_run():
    return simulate(SimConfig())


def by_name(result):
    return {r["name"]: r for r in result["strategies"]}


# ---------------------------------------------------------------- RAM model


def test_first_fit_fails_above_largest_hole():
    ram = AddressSpace(16 * PAGE)
    a = ram.alloc(4 * PAGE)
    b = ram.alloc(4 * PAGE)
    c = ram.alloc(4 * PAGE)
    ram.free(a)
    ram.free(c)  # merges with the tail hole
    assert ram.free_bytes == 12 * PAGE and ram.num_holes == 2 and ram.largest_hole == 8 * PAGE
    assert ram.alloc(9 * PAGE) is None  # enough free in total, no hole large enough
    assert ram.alloc(3 * PAGE) is not None and ram.holes()[0] == (3 * PAGE, PAGE)  # first fit: lowest hole
    ram.free(b)
    ram.check()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40 * PAGE), st.floats(0, 0.999)), max_size=60))
def test_address_space_tiles_exactly(ops):
    ram = AddressSpace(256 * PAGE)
    live = {}
    for is_alloc, size, pick in ops:
        if is_alloc or not live:
            largest = ram.largest_hole
            a = ram.alloc(size)
            assert (a is None) == (-(-size // PAGE) * PAGE > largest)
            if a is not None:
                live[a] = -(-size // PAGE) * PAGE
        else:
            key = sorted(live)[int(pick * len(live))]
            ram.free(key)
            del live[key]
        ram.check()
        assert ram.free_bytes == ram.size - sum(live.values())


@pytest.mark.parametrize("seed", [0, 3])
def test_fragmentation_keeps_free_bytes(seed):
    holes = []
    for frag in (0.0, 0.25, 0.5, 1.0):
        ram, apps = make_ram(4 * 2**30, 2**30, frag, seed)
        ram.check()
        assert ram.free_bytes == 2**30
        holes.append((ram.num_holes, ram.largest_hole))
    assert holes[0] == (1, 2**30)
    assert [h for h, _ in holes] == sorted(h for h, _ in holes) and holes[-1][0] > 64
    assert holes[-1][1] < 2**30


def test_bad_ram_params():
    with pytest.raises(SpecError, match="--fragmentation 1.5"):
        make_ram(2**30, 2**28, 1.5, 0)
    with pytest.raises(SpecError, match="free memory"):
        make_ram(2**30, 2**30, 0.5, 0)
    assert parse_free("0.25") == 0.25 and parse_free("1GiB") == 2**30
    with pytest.raises(SpecError, match="--free 2"):
        parse_free("2")
    with pytest.raises(SpecError, match="--free 'lots' is not a size"):
        parse_free("lots")


# ---------------------------------------------------------------- trace


def test_trace_respects_ctx_and_chats():
    cfg = SimConfig(turns=300, chats=3, ctx=2048, seed=5)
    events = make_trace(cfg)
    assert events == make_trace(cfg)
    live = {}
    for e in events:
        if e.kind == "new":
            live[e.conv] = 0
        elif e.kind == "turn":
            live[e.conv] += e.user + e.assistant
            assert live[e.conv] <= cfg.ctx
        elif e.kind in ("clear", "end"):
            del live[e.conv]
        assert len(live) <= cfg.chats
    assert sum(e.kind == "turn" for e in events) == cfg.turns
    assert {e.kind for e in events} >= {"new", "turn", "end", "app_alloc", "app_free"}


# ---------------------------------------------------------------- simulate


def test_json_shape(default_run):
    out = json.loads(json.dumps(to_json(default_run)))
    assert set(out) == {"params", "strategies"}
    assert [s["name"] for s in out["strategies"]] == list(STRATEGIES)
    for s in out["strategies"]:
        for key, typ in (("tokens_before_failure", int), ("peak_bytes", int), ("utilization", float),
                         ("failures", int)):
            assert isinstance(s[key], typ), key
        assert 0 < s["utilization"] <= 1
        assert len(s["series"]["event"]) == len(s["series"]["tokens"]) == len(s["series"]["bytes_in_use"])
    assert "series" not in to_json(default_run, with_series=False)["strategies"][0]


def test_deterministic(default_run):
    again = simulate(SimConfig())
    assert to_json(again) == to_json(default_run)
    other = simulate(SimConfig(seed=1, turns=100))
    assert to_json(other) != to_json(simulate(SimConfig(seed=2, turns=100)))


def test_default_story(default_run):
    r = by_name(default_run)
    c, f, q = r["contiguous-fp16"], r["paged-fp16"], r["paged-quant"]
    assert q["tokens_before_failure"] > f["tokens_before_failure"] > c["tokens_before_failure"]
    assert 2.2 < q["tokens_before_failure"] / f["tokens_before_failure"] < 2.6
    assert c["first_failure_event"] < f["first_failure_event"]
    assert q["first_failure_event"] is None or f["first_failure_event"] < q["first_failure_event"]
    assert c["failures"] > f["failures"] > q["failures"]
    # same byte budget for both pools, each split in 90 small allocations
    p = default_run["params"]
    assert p["pool_bytes"] == 2 * contiguous_buffer_bytes(SMOL, 8192)
    for s in (f, q):
        assert not s["startup_failed"] and s["pool_bytes"] <= p["pool_bytes"]
        assert s["allocation_count"] == 90 and s["largest_allocation_bytes"] < c["buffer_bytes"] / 10
        assert s["tokens_before_failure"] <= s["capacity_tokens"]
    assert f["utilization"] > 0.95 > 0.6 > c["utilization"]


def test_paged_numbers_come_from_block_pool(default_run):
    for s in default_run["strategies"][1:]:
        pool = s["_pool"]
        assert isinstance(pool, BlockPool)
        pool.check_invariants()
        assert pool.num_blocks == s["num_blocks"]
        assert s["series"]["tokens"][-1] == sum(pool.length(q) for q in pool.live_sequences())
        assert s["pool_stats"] == pool.stats()
        for fail in s["failure_events"]:
            assert fail["kind"] == "pool_exhausted"


def test_pool_does_not_fit_fragmented_ram():
    cfg = SimConfig(fragmentation=1.0, free=0.15, turns=20)
    r = by_name(simulate(cfg, strategies=("paged-fp16",)))["paged-fp16"]
    assert cfg.free_bytes() > r["pool_bytes"]  # enough free memory in total...
    assert r["startup_failed"] and r["failures"] == 1 and r["tokens_before_failure"] == 0  # ...but no hole fits
    assert "does not fit" in r["failure_events"][0]["detail"]
    ok = by_name(simulate(SimConfig(fragmentation=0.0, free=0.15, turns=20), strategies=("paged-fp16",)))
    assert not ok["paged-fp16"]["startup_failed"]


def test_bad_config():
    with pytest.raises(SpecError, match="--turns 0"):
        simulate(SimConfig(turns=0))
    with pytest.raises(SpecError, match="too small for one 16-token block"):
        simulate(SimConfig(pool_bytes=1000, turns=5))


def test_plot_writes_png(tmp_path):
    result = simulate(SimConfig(turns=60))
    path = tmp_path / "sim.png"
    plot(result, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- the compact ladder


def test_compact_split_layout_keeps_the_budget():
    from runtime_sim.simulate import compact_split_layout
    from runtime_sim.plan import blocks_for_budget, pool_layout
    from toolkit.kv_spec import parse_spec

    spec = parse_spec("default")[1]
    budget = 120 * 2**20
    full = pool_layout(spec, SMOL, blocks_for_budget(spec, SMOL, budget, 16, 8), 16, 8)
    for share in (0.1, 0.5, 0.9):
        split = compact_split_layout(full, budget, share)
        assert split.total_bytes <= budget and split.num_compact_blocks > 0
        assert split.num_blocks == max(1, round(full.num_blocks * (1 - share)))
        # the compact region holds more tokens than the default blocks it replaced, in fewer bytes
        assert split.num_compact_blocks > full.num_blocks - split.num_blocks
        assert split.compact_bytes_per_token < split.bytes_per_token
    with pytest.raises(SpecError, match="--compact-share"):
        simulate(SimConfig(compact_share=1.0, turns=5))
    with pytest.raises(SpecError, match="--compact-share"):
        simulate(SimConfig(compact_share="half", turns=5))
    with pytest.raises(SpecError, match="--compact-horizon"):
        simulate(SimConfig(compact_horizon=0, turns=5))


def test_auto_compact_split_keeps_every_chats_horizon_in_default_blocks():
    """compact_share "auto" (the default): the default region is sized for the expected chats (sink block,
    the last horizon's blocks and the one straddling it, each) and one turn; the rest is compact."""
    from runtime_sim.simulate import compact_split_layout, default_region_blocks, max_turn_tokens
    from runtime_sim.plan import blocks_for_budget, pool_layout
    from toolkit.kv_spec import parse_spec

    assert SimConfig().compact_share == "auto"
    # 1 sink + 64 blocks of 1,024 tokens + 1 straddling, per chat; a 2,048-token turn is 128 blocks
    assert default_region_blocks(8, 1024, 2048, 16) == 8 * 66 + 128
    assert default_region_blocks(2, 1000, 17, 16, sink_blocks=2) == 2 * (2 + 63 + 1) + 2
    spec = parse_spec("default")[1]
    budget = 120 * 2**20
    full = pool_layout(spec, SMOL, blocks_for_budget(spec, SMOL, budget, 16, 8), 16, 8)
    turn = max_turn_tokens(SimConfig())
    split = compact_split_layout(full, budget, "auto", 8, 1024, turn)
    assert split.num_blocks == default_region_blocks(8, 1024, turn, 16)
    assert split.total_bytes <= budget and split.num_compact_blocks > full.num_blocks - split.num_blocks
    # fewer chats or a shorter horizon: a smaller default region, a bigger compact one
    small = compact_split_layout(full, budget, "auto", 4, 512, turn)
    assert small.num_blocks < split.num_blocks and small.num_compact_blocks > split.num_compact_blocks
    # 16 horizons of 1,024 do not fit in 120 MiB: no compact region (the ladder is spill, then slide)
    assert compact_split_layout(full, budget, "auto", 16, 1024, turn) == full
    cfg = SimConfig(chats=16, turns=120, pool_bytes=budget, flash_bytes=0)
    ladder, comp = to_json(simulate(cfg, strategies=("paged-quant-ladder", "paged-quant-compact")),
                           with_series=False)["strategies"]
    assert comp["num_compact_blocks"] == 0 and comp["compact_spec"] is None and comp["pressure"]["compactions"] == 0
    assert comp["peak_tokens_before_loss"] == ladder["peak_tokens_before_loss"]


def test_auto_compact_ladder_does_not_lose_to_evict_in_a_small_pool():
    """RAM only, 8 chats in 120 MiB: with half the pool compact the default half cannot hold 8 horizons and
    the active chat slid before evict lost a cache (0.87-0.97x); the automatic split holds more than evict."""
    for share in ("auto", 0.5):
        cfg = SimConfig(chats=8, turns=700, seed=0, pool_bytes=120 * 2**20, flash_bytes=0, compact_share=share)
        evict, comp = to_json(simulate(cfg, strategies=("paged-quant-evict", "paged-quant-compact")),
                              with_series=False)["strategies"]
        ratio = comp["peak_tokens_before_loss"] / evict["peak_tokens_before_loss"]
        if share == "auto":
            assert ratio > 1.05 and comp["pressure"]["compactions"] > 0
        else:
            assert ratio < 1.0  # the fixed half-and-half split, for contrast


def test_compact_ladder_holds_more_in_ram_than_evict():
    """RAM only (no flash): the compact rung is what lets the pool hold more; it loses no token, and
    only blocks the horizon rule allows are compact (never a chat's block 0 or its last block)."""
    cfg = SimConfig(chats=16, turns=250, seed=1, flash_bytes=0)
    res = simulate(cfg, strategies=("paged-quant-evict", "paged-quant-compact"))
    evict, comp = res["strategies"]
    pool = comp["_pool"]
    pool.check_invariants()
    p = comp["pressure"]
    assert p["compactions"] > 0 and p["compacted_blocks"] > 0 and p["spills"] == 0 and p["evictions"] == 0
    assert comp["pool_bytes"] <= res["params"]["pool_bytes"]  # the same budget as evict's pool
    assert comp["peak_tokens_before_loss"] > evict["peak_tokens_before_loss"]
    assert pool.num_compact_blocks == comp["num_compact_blocks"] > 0
    for seq in pool.live_sequences():
        table, n = pool.block_table(seq), pool.length(seq)
        compact = [i for i, b in enumerate(table) if b >= pool.num_blocks]
        assert 0 not in compact
        # compacted when aged: ended >= the horizon back at the time, so never within the last horizon now
        assert all((i + 1) * cfg.block_size <= n - cfg.compact_horizon for i in compact)


def test_compact_ladder_spills_with_flash():
    cfg = SimConfig(chats=8, turns=300, seed=0, pool_bytes=120 * 2**20)
    evict, ladder, comp = to_json(simulate(cfg, strategies=("paged-quant-evict", "paged-quant-ladder",
                                                            "paged-quant-compact")), with_series=False)["strategies"]
    p = comp["pressure"]
    assert p["compactions"] > 0 and p["spills"] > 0 and p["restores"] > 0 and comp["losses"] == 0
    assert comp["turns_served"] == cfg.turns
    assert comp["peak_tokens_before_loss"] >= 1.8 * evict["peak_tokens_before_loss"]
    assert comp["compact_spec"] and comp["compact_horizon"] == 1024
