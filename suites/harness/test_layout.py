"""Tests for harness.parallel.layout: grammar, validation, enumeration, Megatron kwargs.

Pure Python: no processes and no torch/megatron import (Megatron's signature is
read from its installed source with ast, which is what inspect.signature would
report but without the multi-second import).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import pathlib
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.parallel.layout import (
    Layout,
    LayoutError,
    enumerate_layouts,
    is_valid,
    parse_layout,
    parse_layout_list,
    resolve,
    validate,
)

# Tiny dense model: 4 heads / 2 KV groups / 4 layers, the shapes the harness tests use.
TINY = types.SimpleNamespace(num_attention_heads=4, num_query_groups=2, num_layers=4, hidden_size=64)


def names(layouts: list[Layout]) -> list[str]:
    return [layout.name for layout in layouts]


# ----------------------------------------------------------------------------- Layout


@pytest.mark.parametrize(
    ("layout", "name"),
    [
        (Layout(), "tp1"),
        (Layout(tp=2), "tp2"),
        (Layout(pp=2), "pp2"),
        (Layout(dp=2), "dp2"),
        (Layout(tp=2, pp=2), "tp2pp2"),
        (Layout(tp=2, dp=2, sequence_parallel=True), "tp2dp2-sp"),
        (Layout(pp=2, vpp=2), "pp2vpp2"),
        (Layout(pp=2, vpp=1), "pp2vpp1"),
        (Layout(tp=2, pp=2, dp=2), "tp2pp2dp2"),
        (Layout(tp=2, pp=2, vpp=3, cp=2, ep=2, dp=2, sequence_parallel=True), "tp2pp2vpp3cp2ep2dp2-sp"),
    ],
)
def test_name_is_canonical(layout: Layout, name: str) -> None:
    assert layout.name == name
    assert str(layout) == name


def test_world_size_ignores_ep_and_vpp() -> None:
    # ep lives inside dp*cp and vpp inside pp: neither adds ranks.
    assert Layout(tp=2, pp=2, cp=2, dp=2, ep=4, vpp=2).world_size == 16
    assert Layout(tp=2, pp=3).model_parallel_size == 6


@pytest.mark.parametrize("layout, good, bad", [
    (Layout(), [1, 3], [0, -1, 2.0]),
    (Layout(pp=2), [1, 3], [0]),
    (Layout(pp=2, vpp=2), [2, 4], [1, 3]),  # megatron-core's interleaved schedule: pp per call
])
def test_micro_batch_counts_are_checked_against_the_schedule(layout: Layout, good: list, bad: list) -> None:
    for count in good:
        layout.check_micro_batches(count)
    for count in bad:
        with pytest.raises(ValueError, match="positive integer|interleaved"):
            layout.check_micro_batches(count)


def test_layout_is_frozen_and_hashable() -> None:
    layout = Layout(tp=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.tp = 4  # type: ignore[misc]
    assert {Layout(tp=2), Layout(tp=2), Layout()} == {Layout(tp=2), Layout()}


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"tp": 0}, "tp=0 must be a positive integer"),
        ({"dp": -1}, "dp=-1 must be a positive integer"),
        ({"pp": True}, "pp=True must be a positive integer"),
        ({"cp": 1.5}, "cp=1.5 must be a positive integer"),
        ({"ep": 0}, "ep=0 must be a positive integer"),
        ({"vpp": 2}, "vpp=2 requires pp >= 2"),
        ({"pp": 2, "vpp": 0}, "vpp=0 must be None or a positive integer"),
        ({"sequence_parallel": True}, "sequence_parallel requires tp > 1"),
        ({"tp": 2, "sequence_parallel": 1}, "sequence_parallel=1 must be a bool"),
    ],
)
def test_invalid_fields_raise(kwargs: dict, fragment: str) -> None:
    with pytest.raises(LayoutError, match="invalid Layout") as info:
        Layout(**kwargs)
    assert fragment in str(info.value)


def test_field_errors_are_all_reported() -> None:
    with pytest.raises(LayoutError) as info:
        Layout(tp=0, vpp=2)
    assert "tp=0" in str(info.value) and "vpp=2" in str(info.value)


def test_layout_error_is_value_error() -> None:
    assert issubclass(LayoutError, ValueError)


# ---------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("tp1", Layout()),
        ("tp2pp2", Layout(tp=2, pp=2)),
        ("tp2-dp2-sp", Layout(tp=2, dp=2, sequence_parallel=True)),
        ("TP2_PP2", Layout(tp=2, pp=2)),
        ("pp2vpp2", Layout(pp=2, vpp=2)),
        ("vpp2pp2", Layout(pp=2, vpp=2)),
        ("dp2", Layout(dp=2)),
        ("tp2xpp2", Layout(tp=2, pp=2)),
        ("tp2 x pp2", Layout(tp=2, pp=2)),
        ("tp2 pp2\tdp2", Layout(tp=2, pp=2, dp=2)),
        ("tp2sp", Layout(tp=2, sequence_parallel=True)),
        ("sp-tp4", Layout(tp=4, sequence_parallel=True)),
        ("tp2_sequence_parallel", Layout(tp=2, sequence_parallel=True)),
        ("Sequence-Parallel TP2", Layout(tp=2, sequence_parallel=True)),
        ("  tp2-  ", Layout(tp=2)),
        ("tp02", Layout(tp=2)),
        ("tp12", Layout(tp=12)),
        ("cp2ep2dp4", Layout(cp=2, ep=2, dp=4)),
    ],
)
def test_parse_variants(text: str, expected: Layout) -> None:
    assert parse_layout(text) == expected
    assert Layout.parse(text) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("tp2foo", "unknown token 'foo'"),
        ("tq2", "unknown token 'tq2'"),
        ("tp2.pp2", "unknown token '.pp2'"),
        ("xtp2", "unknown token 'xtp2'"),
        ("tp2x", "unknown token 'x'"),
        ("sp2tp2", "unknown token '2tp2'"),
        ("tp", "dim 'tp' needs a size"),
        ("tp2-pp", "dim 'pp' needs a size"),
        ("tp2tp2", "'tp' given more than once"),
        ("tp2-sp-sp", "'sp' given more than once"),
        ("tp0", "tp0: size must be a positive integer"),
        ("pp2vpp0", "vpp0: size must be a positive integer"),
        ("", "empty layout"),
        ("-_ ", "empty layout"),
        ("tp2,sp", "use parse_layout_list"),
    ],
)
def test_parse_errors_name_the_token_and_grammar(text: str, fragment: str) -> None:
    with pytest.raises(LayoutError) as info:
        parse_layout(text)
    message = str(info.value)
    assert fragment in message
    assert repr(text) in message
    assert "accepted grammar" in message


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("vpp2", "vpp=2 requires pp >= 2"),
        ("sp", "sequence_parallel requires tp > 1"),
        ("tp1-sp", "sequence_parallel requires tp > 1"),
    ],
)
def test_parse_semantic_errors_name_the_layout(text: str, fragment: str) -> None:
    with pytest.raises(LayoutError) as info:
        parse_layout(text)
    assert str(info.value).startswith(f"layout {text!r} is not valid: {fragment}")


def test_parse_rejects_non_string() -> None:
    with pytest.raises(LayoutError, match="must be a string"):
        parse_layout(2)  # type: ignore[arg-type]


def test_parse_layout_list() -> None:
    assert parse_layout_list("tp1,tp2,pp2") == [Layout(), Layout(tp=2), Layout(pp=2)]
    assert parse_layout_list(" tp2-sp , TP2_PP2 ") == [
        Layout(tp=2, sequence_parallel=True),
        Layout(tp=2, pp=2),
    ]
    assert parse_layout_list("dp2") == [Layout(dp=2)]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("tp1,,tp2", "empty entry"),
        ("tp1,", "empty entry"),
        ("", "empty entry"),
        ("tp2,pp2,TP2", "names tp2 more than once"),
        ("tp2,sp", "sequence_parallel requires tp > 1"),
        ("tp2,bogus", "unknown token 'bogus'"),
    ],
)
def test_parse_layout_list_errors(text: str, fragment: str) -> None:
    with pytest.raises(LayoutError) as info:
        parse_layout_list(text)
    assert fragment in str(info.value)


# -------------------------------------------------------------------- round-trip props


@st.composite
def valid_layouts(draw: st.DrawFn) -> Layout:
    tp = draw(st.integers(1, 16))
    pp = draw(st.integers(1, 16))
    vpp = draw(st.none() | st.integers(1, 8)) if pp > 1 else None
    sp = draw(st.booleans()) if tp > 1 else False
    return Layout(
        tp=tp,
        pp=pp,
        dp=draw(st.integers(1, 16)),
        cp=draw(st.integers(1, 8)),
        ep=draw(st.integers(1, 8)),
        vpp=vpp,
        sequence_parallel=sp,
    )


@given(valid_layouts())
def test_name_round_trips(layout: Layout) -> None:
    assert parse_layout(layout.name) == layout


@st.composite
def spellings(draw: st.DrawFn, layout: Layout) -> str:
    """Any order, explicit 1s, any separator and case for the same layout."""
    parts = [
        f"{dim}{getattr(layout, dim)}"
        for dim in ("tp", "pp", "vpp", "cp", "ep", "dp")
        if getattr(layout, dim) is not None
    ]
    if layout.sequence_parallel:
        parts.append(draw(st.sampled_from(["sp", "sequence_parallel", "sequence-parallel"])))
    parts = draw(st.permutations(parts))
    sep = draw(st.sampled_from(["", "-", "_", " ", "x", " x ", "-x-", "__"]))
    text = sep.join(parts)
    return text.upper() if draw(st.booleans()) else text


@settings(max_examples=60)
@given(st.data())
def test_alternative_spellings_round_trip(data: st.DataObject) -> None:
    layout = data.draw(valid_layouts())
    assert parse_layout(data.draw(spellings(layout))) == layout


@settings(max_examples=40)
@given(st.lists(valid_layouts(), min_size=1, max_size=5, unique=True))
def test_list_round_trips(layouts: list[Layout]) -> None:
    assert parse_layout_list(",".join(names(layouts))) == layouts


# --------------------------------------------------------------------------- resolving


@pytest.mark.parametrize(
    ("text", "world", "expected"),
    [
        ("tp1", 1, Layout()),
        ("tp1", 4, Layout(dp=4)),
        ("tp2", 4, Layout(tp=2, dp=2)),
        ("tp2pp2", 4, Layout(tp=2, pp=2)),
        ("tp2pp2", 8, Layout(tp=2, pp=2, dp=2)),
        ("pp2vpp2", 4, Layout(pp=2, vpp=2, dp=2)),
        ("tp2-sp", 8, Layout(tp=2, dp=4, sequence_parallel=True)),
        ("cp2", 4, Layout(cp=2, dp=2)),
        ("tp2dp2", 4, Layout(tp=2, dp=2)),
    ],
)
def test_resolve_fills_dp(text: str, world: int, expected: Layout) -> None:
    assert resolve(parse_layout(text), world) == expected
    assert validate(expected, world) is expected


def test_with_dp_for() -> None:
    assert Layout(tp=2).with_dp_for(8) == Layout(tp=2, dp=4)
    # An explicit dp is overwritten: with_dp_for always derives it.
    assert Layout(tp=2, dp=3).with_dp_for(4) == Layout(tp=2, dp=2)


@pytest.mark.parametrize(
    ("layout", "world", "fragment"),
    [
        (Layout(tp=3), 4, "tp*pp*cp = 3 does not divide 4"),
        (Layout(tp=2, pp=2), 2, "tp*pp*cp = 4 does not divide 2"),
        (Layout(tp=2, dp=2), 8, "needs 4 ranks (tp*pp*cp*dp) but world size is 8"),
        (Layout(tp=2), 0, "world size must be a positive integer"),
    ],
)
def test_resolve_errors(layout: Layout, world: int, fragment: str) -> None:
    with pytest.raises(LayoutError) as info:
        resolve(layout, world)
    assert fragment in str(info.value)


# -------------------------------------------------------------------------- validation


def test_validate_message_format() -> None:
    named = types.SimpleNamespace(**vars(TINY), name="tiny-qwen3")
    with pytest.raises(LayoutError) as info:
        validate(Layout(tp=3), 4, named)
    assert str(info.value) == (
        "layout tp3 is invalid for world size 4 and model tiny-qwen3:\n"
        "  - tp=3 does not divide num_attention_heads=4\n"
        "  - tp=3 does not divide num_query_groups=2\n"
        "  - tp*pp*cp*dp = 3 != world size 4"
    )


@pytest.mark.parametrize(
    ("layout", "world", "problems"),
    [
        (Layout(tp=4), 4, ["tp=4 does not divide num_query_groups=2"]),
        (
            Layout(tp=3),
            3,
            ["tp=3 does not divide num_attention_heads=4", "tp=3 does not divide num_query_groups=2"],
        ),
        (Layout(pp=3), 3, ["pp=3 does not divide num_layers=4"]),
        (Layout(pp=4, vpp=2), 4, ["pp*vpp = 4*2 = 8 does not divide num_layers=4"]),
        (Layout(ep=2, dp=2), 2, ["ep=2 requires a MoE model, but the model has no experts"]),
    ],
)
def test_validate_model_problems(layout: Layout, world: int, problems: list[str]) -> None:
    # World sizes match here, so only the model problems are listed, and the header names only the
    # model: the world size is not what is wrong.
    with pytest.raises(LayoutError) as info:
        validate(layout, world, TINY)
    header = f"layout {layout.name} is invalid for the given model config:"
    assert str(info.value).splitlines() == [header] + [f"  - {problem}" for problem in problems]


def test_validate_world_size_mismatch_hints_resolve() -> None:
    with pytest.raises(LayoutError) as info:
        validate(Layout(tp=2), 4)
    assert str(info.value) == (
        "layout tp2 is invalid for world size 4:\n"
        "  - tp*pp*cp*dp = 2 != world size 4 (resolve(layout, world_size) fills dp from the world size)"
    )


def test_validate_ep_must_divide_dp_cp() -> None:
    with pytest.raises(LayoutError, match=r"ep=4 does not divide dp\*cp = 2"):
        validate(Layout(ep=4, dp=2), 2)
    assert validate(Layout(ep=4, dp=2, cp=2), 4) == Layout(ep=4, dp=2, cp=2)


def test_validate_accepts_good_layouts_and_returns_them() -> None:
    for layout in (Layout(tp=2, dp=2), Layout(tp=2, pp=2, sequence_parallel=True), Layout(pp=2, vpp=2, dp=2)):
        assert validate(layout, 4, TINY) is layout
        assert is_valid(layout, 4, TINY)
    assert not is_valid(Layout(tp=4), 4, TINY)


def test_validate_hf_attribute_names() -> None:
    hf = types.SimpleNamespace(
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=6,
        hidden_size=64,
        intermediate_size=96,
        _name_or_path="hf-tiny",
    )
    assert validate(Layout(tp=2, pp=3), 6, hf)
    with pytest.raises(LayoutError) as info:
        validate(Layout(tp=4, pp=4), 16, hf)
    message = str(info.value)
    assert "is invalid for model hf-tiny:" in message  # 16 ranks is right: no world size named
    assert "tp=4 does not divide num_query_groups=2" in message
    assert "pp=4 does not divide num_layers=6" in message
    assert "num_attention_heads" not in message  # 4 heads split fine over tp=4


def test_validate_query_groups_default_to_heads() -> None:
    mha = types.SimpleNamespace(num_attention_heads=4, num_query_groups=None, num_layers=2, hidden_size=64)
    assert validate(Layout(tp=4), 4, mha)


def test_validate_ffn_width() -> None:
    model = types.SimpleNamespace(**{**vars(TINY), "num_query_groups": 4, "ffn_hidden_size": 6})
    assert validate(Layout(tp=2, dp=2), 4, model)
    with pytest.raises(LayoutError, match="tp=4 does not divide ffn_hidden_size=6"):
        validate(Layout(tp=4), 4, model)


@pytest.mark.parametrize("attr", ["num_moe_experts", "num_experts", "num_local_experts"])
def test_validate_moe_experts(attr: str) -> None:
    moe = types.SimpleNamespace(**vars(TINY), **{attr: 4})
    assert validate(Layout(ep=4, dp=4), 4, moe)
    assert validate(Layout(tp=2, ep=2, dp=2, sequence_parallel=True), 4, moe)
    with pytest.raises(LayoutError, match="tp=2 with experts needs sequence parallelism"):
        validate(Layout(tp=2, ep=2, dp=2), 4, moe)
    with pytest.raises(LayoutError, match="ep=3 does not divide num_moe_experts=4"):
        validate(Layout(ep=3, dp=3), 3, moe)


def test_validate_collects_every_problem() -> None:
    with pytest.raises(LayoutError) as info:
        validate(Layout(tp=3, pp=3, ep=2), 4, TINY)
    lines = str(info.value).splitlines()[1:]
    assert lines == [
        "  - tp=3 does not divide num_attention_heads=4",
        "  - tp=3 does not divide num_query_groups=2",
        "  - pp=3 does not divide num_layers=4",
        "  - ep=2 requires a MoE model, but the model has no experts",
        "  - tp*pp*cp*dp = 9 != world size 4",
        "  - ep=2 does not divide dp*cp = 1",
    ]


def test_validate_rejects_bad_world_size() -> None:
    with pytest.raises(LayoutError, match="world size must be a positive integer"):
        validate(Layout(), 0)


@pytest.mark.parametrize("layout, micro_batches, rows", [
    (Layout(tp=2), 2, 2),
    (Layout(dp=4), 1, 4),  # 2 rows do not split over 4 data-parallel ranks
    (Layout(pp=2, vpp=2, dp=2), 2, 4),
    (Layout(pp=4, vpp=2), 4, 4),
])
def test_fitted_rows_split_over_data_parallel_ranks_and_micro_batches(layout: Layout, micro_batches: int,
                                                                      rows: int) -> None:
    assert layout.fitted_rows(2, micro_batches) == rows


def test_fitted_micro_batches_are_the_least_multiple_the_schedule_takes() -> None:
    assert [Layout(pp=4).fitted_micro_batches(2), Layout(pp=2, vpp=2).fitted_micro_batches(1),
            Layout(pp=4, vpp=2).fitted_micro_batches(2), Layout(pp=4, vpp=2).fitted_micro_batches(8)] == [2, 2, 4, 8]


# ------------------------------------------------------------------------- enumeration


def test_enumerate_one_rank() -> None:
    assert enumerate_layouts(1) == [Layout()]
    assert enumerate_layouts(1, TINY) == [Layout()]


def test_enumerate_two_ranks() -> None:
    assert set(names(enumerate_layouts(2))) == {"tp2", "tp2-sp", "pp2", "pp2vpp2", "dp2"}
    assert set(names(enumerate_layouts(2, TINY))) == {"tp2", "tp2-sp", "pp2", "pp2vpp2", "dp2"}
    # 2 layers cannot feed pp2 * vpp2 = 4 virtual stages.
    two_layers = types.SimpleNamespace(**{**vars(TINY), "num_layers": 2})
    assert set(names(enumerate_layouts(2, two_layers))) == {"tp2", "tp2-sp", "pp2", "dp2"}


FOUR_RANKS = {
    "dp4", "tp2dp2", "tp2dp2-sp", "pp2dp2", "pp2vpp2dp2", "tp2pp2", "tp2pp2-sp",
    "tp2pp2vpp2", "tp2pp2vpp2-sp", "tp4", "tp4-sp", "pp4", "pp4vpp2",
}


def test_enumerate_four_ranks() -> None:
    assert set(names(enumerate_layouts(4))) == FOUR_RANKS
    # tp4 breaks query groups=2; pp4*vpp2 = 8 stages exceed 4 layers.
    assert set(names(enumerate_layouts(4, TINY))) == FOUR_RANKS - {"tp4", "tp4-sp", "pp4vpp2"}


def test_enumerate_switches() -> None:
    assert set(names(enumerate_layouts(4, allow_sp=False, allow_vpp=False))) == {
        "dp4", "tp2dp2", "pp2dp2", "tp2pp2", "tp4", "pp4",
    }
    assert "pp4vpp3" in names(enumerate_layouts(4, max_vpp=3))
    assert set(names(enumerate_layouts(2, allow_sp=False, allow_vpp=False, cp=True))) == {"tp2", "pp2", "cp2", "dp2"}
    moe = types.SimpleNamespace(**vars(TINY), num_moe_experts=2)
    assert set(names(enumerate_layouts(2, moe, allow_sp=False, allow_vpp=False, ep=True))) == {
        "pp2", "dp2", "ep2dp2",  # tp2 with experts needs sequence parallelism
    }
    # ep variants need experts when a model is given.
    assert "ep2dp2" not in names(enumerate_layouts(2, TINY, ep=True))


@pytest.mark.parametrize("world", range(1, 9))
def test_enumerate_is_sorted_unique_and_valid(world: int) -> None:
    layouts = enumerate_layouts(world, cp=True, ep=True)
    assert len(set(layouts)) == len(layouts)
    assert layouts == enumerate_layouts(world, cp=True, ep=True)  # deterministic
    keys = [(l.tp, l.pp, l.vpp or 0, l.cp, l.ep, l.dp, l.sequence_parallel) for l in layouts]
    assert keys == sorted(keys)
    for layout in layouts:
        assert layout.world_size == world
        assert validate(layout, world) is layout


def test_enumerate_rejects_bad_world_size() -> None:
    with pytest.raises(LayoutError, match="world size must be a positive integer"):
        enumerate_layouts(0)


# ---------------------------------------------------------------------------- Megatron


def _megatron_source(relative: str) -> ast.Module:
    # `megatron` is a namespace package, so find_spec does not import megatron.core.
    spec = importlib.util.find_spec("megatron")
    assert spec is not None and spec.submodule_search_locations, "megatron-core is not installed"
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / relative
    return ast.parse(path.read_text())


def _initialize_model_parallel_defaults() -> dict[str, object]:
    tree = _megatron_source("core/parallel_state.py")
    func = next(
        node for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name == "initialize_model_parallel"
    )
    assert not func.args.vararg and not func.args.kwarg  # unknown keywords would be rejected
    params = func.args.args + func.args.kwonlyargs
    # Positional defaults align with the last positional params; kw-only ones pair up.
    defaults = [None] * (len(func.args.args) - len(func.args.defaults)) + func.args.defaults + func.args.kw_defaults
    return {
        param.arg: default.value if isinstance(default, ast.Constant) else "<no literal default>"
        for param, default in zip(params, defaults)
    }


def _model_parallel_config_fields() -> set[str]:
    tree = _megatron_source("core/model_parallel_config.py")
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "ModelParallelConfig")
    return {node.target.id for node in cls.body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}


def test_megatron_kwargs_match_initialize_model_parallel() -> None:
    defaults = _initialize_model_parallel_defaults()
    kwargs = Layout().megatron_kwargs()
    assert set(kwargs) <= set(defaults)
    # The trivial layout asks Megatron for exactly its own defaults.
    assert kwargs == {key: defaults[key] for key in kwargs}


def test_megatron_kwargs_values() -> None:
    layout = Layout(tp=2, pp=4, vpp=2, cp=2, ep=2, dp=2, sequence_parallel=True)
    assert layout.megatron_kwargs() == {
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 4,
        "virtual_pipeline_model_parallel_size": 2,
        "context_parallel_size": 2,
        "hierarchical_context_parallel_sizes": None,
        "expert_model_parallel_size": 2,
        "expert_tensor_parallel_size": None,
    }
    assert Layout(tp=2, ep=2, etp=1).megatron_kwargs()["expert_tensor_parallel_size"] == 1
    assert layout.config_kwargs() == {**layout.megatron_kwargs(), "sequence_parallel": True}


def test_cp_of_4_and_more_gets_the_two_level_groups_of_the_hierarchical_exchange() -> None:
    """megatron-core's a2a+p2p runs all-to-all inside pairs of CP ranks and a ring between the pairs."""
    assert [Layout(cp=c).hierarchical_cp_sizes for c in (1, 2, 3, 4, 8)] == [None, None, None, [2, 2], [2, 4]]
    assert Layout(cp=4, tp=2).megatron_kwargs()["hierarchical_context_parallel_sizes"] == [2, 2]


def test_config_kwargs_are_model_parallel_config_fields() -> None:
    assert set(Layout().config_kwargs()) <= _model_parallel_config_fields()


# --------------------------------------------------------------------------- etp
def test_etp_parses_names_and_round_trips_and_etp_equal_to_tp_is_the_default() -> None:
    layout = parse_layout("tp2 x ep2 x etp1")
    assert (layout.tp, layout.ep, layout.etp, layout.expert_tp) == (2, 2, 1, 1)
    assert layout.name == "tp2ep2etp1" and parse_layout(layout.name) == layout
    assert parse_layout("tp2etp2") == parse_layout("tp2") and parse_layout("tp2etp2").name == "tp2"
    assert Layout(tp=2).expert_tp == 2


def test_etp_times_ep_must_divide_the_ranks_of_a_stage_and_etp_needs_experts() -> None:
    moe = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4,
           "intermediate_size": 128, "num_experts": 4, "moe_intermediate_size": 32}

    class Config:
        def __init__(self, **fields):
            self.__dict__.update(fields)

    assert validate(parse_layout("tp2ep2etp1-sp"), 2, Config(**moe)).name == "tp2ep2etp1-sp"
    with pytest.raises(LayoutError, match="tp=2 with experts needs sequence parallelism"):
        validate(parse_layout("tp2ep2etp1"), 2, Config(**moe))
    with pytest.raises(LayoutError, match=r"ep=2 does not divide dp\*cp = 1"):
        validate(parse_layout("tp2ep2-sp"), 2, Config(**moe))
    with pytest.raises(LayoutError, match=r"etp\*ep = 1\*4 does not divide tp\*dp\*cp = 2"):
        validate(parse_layout("tp2ep4etp1-sp"), 2, Config(**moe))
    with pytest.raises(LayoutError, match="etp=1 requires a MoE model"):
        validate(parse_layout("tp2etp1"), 2, Config(**{k: v for k, v in moe.items() if "moe" not in k and k != "num_experts"}))
    with pytest.raises(LayoutError, match="etp=3 does not divide the expert ffn_hidden_size=32"):
        validate(Layout(tp=1, etp=3, dp=3, ep=1), 3, Config(**moe))
    with pytest.raises(LayoutError, match="etp=0 must be None or a positive integer"):
        Layout(etp=0)


def test_a_cp_layout_is_refused_for_sliding_window_and_latent_attention():
    """CP's attentions here run full causal attention: a windowed model (Gemma 3) is refused before any
    rank starts; a window the config turns off (Qwen2's use_sliding_window=False) is not one."""
    from harness.models import load_hf_config

    with pytest.raises(LayoutError, match="sliding-window attention"):
        validate(parse_layout("cp2"), 2, load_hf_config("tiny-gemma3"))
    validate(parse_layout("tp2"), 2, load_hf_config("tiny-gemma3"))
    qwen2 = load_hf_config("tiny-qwen2")
    qwen2.sliding_window, qwen2.use_sliding_window = 16, False
    validate(parse_layout("cp2"), 2, qwen2)
    with pytest.raises(LayoutError, match="multi-head latent attention"):
        validate(parse_layout("cp2"), 2, load_hf_config("tiny-deepseek-v3"))
