"""The per-kernel profile: categories of known kernel names, the XSpace reading (a GPU plane written
by hand, a host trace captured on the CPU), and the script end to end at a tiny shape."""

import json

import jax
import jax.numpy as jnp
import pytest

from ddtree_jax import tree
from ddtree_jax.bench import profile as kp


@pytest.mark.parametrize(
    ("name", "hlo_op", "op_name", "expected"),
    [
        ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "custom-call.12", "jit(f)/layer3/mlp/dot_general", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "custom-call.4", "", "gemm"),
        (
            "gemv2T_kernel_val<int, int, __nv_bfloat16, float, 128, 16, 4, 4, false, false>",
            "cublas-gemm.1",
            "",
            "gemm",
        ),
        ("gemm_fusion_dot_45", "gemm_fusion_dot.45", "jit(f)/verify/layer0/attention/dot_general", "gemm"),
        (
            "tree_attention",
            "custom-call.7",
            "jit(f)/verify/layer0/attention/pallas_call",
            "attention:tree_attention",
        ),
        (
            "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x64x128",
            "custom-call.9",
            "",
            "attention:cudnn_generated_fort_native_sdpa_sm90_knob_7_64x64x128",
        ),
        (
            "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
            "all-reduce-start.2",
            "",
            "collective",
        ),
        ("splitKreduce_kernel", "custom-call.4", "", "gemm"),
        ("MemcpyD2H", "", "", "copy"),
        ("Memset", "", "", "copy"),
        ("loop_dynamic_update_slice_fusion_3", "dynamic-update-slice.3", "jit(f)/commit/scatter", "copy"),
        ("sort_33", "sort.33", "jit(f)/draft/sort", "sort_topk"),
        ("input_reduce_fusion_7", "input_reduce_fusion.7", "jit(f)/verify/reduce_max", "fusion"),
        ("loop_multiply_fusion_2", "loop_multiply_fusion.2", "jit(f)/verify/layer0/mlp/mul", "fusion"),
        ("while.5", "while.5", "jit(f)/while", "control"),
        ("quant_matmul", "custom-call.2", "jit(f)/layer0/mlp/pallas_call", "gemm"),
        ("some_pallas_kernel", "custom-call.3", "jit(f)/pallas_call", "pallas:some_pallas_kernel"),
        ("cudaGraphLaunch", "", "", "other"),
    ],
)
def test_categorize_known_kernels(name, hlo_op, op_name, expected):
    assert kp.categorize(name, hlo_op, op_name) == expected


def test_scope_of_reads_the_engine_scopes():
    assert (
        kp.scope_of("jit(decode_rounds)/while/body/verify/layer12/attention/dot_general")
        == "verify/attention"
    )
    assert kp.scope_of("jit(decode_rounds)/while/body/draft/draft_layer0/mlp/mul") == "draft/mlp"
    assert kp.scope_of("jit(verify_passes)/while/body/layer3/add") == "layer_other"
    assert kp.scope_of("jit(decode_rounds)/while/body/verify/dot_general") == "verify/outside_layers"
    assert kp.scope_of("") == "outside_layers"


def _event(meta: int, offset_us: float, dur_us: float, hlo_op: str | None = None) -> str:
    stats = "" if hlo_op is None else f' stats {{ metadata_id: 1 str_value: "{hlo_op}" }}'
    times = f"offset_ps: {int(offset_us * 1e6)} duration_ps: {int(dur_us * 1e6)}"
    return f"events {{ metadata_id: {meta} {times}{stats} }}"


# A device plane as CUPTI writes it: two streams (one kernel overlaps the other stream's), a derived
# "XLA Ops" line repeating a kernel (not to be counted twice) and a CUPTI overhead line.
GPU_XSPACE = f"""
planes {{
  id: 1 name: "/device:GPU:0"
  lines {{ id: 7 name: "Stream #7(Kernel,MemcpyD2H)" timestamp_ns: 1000
    {_event(1, 0, 50, "custom-call.3")} {_event(2, 60, 30, "tree_attention_call")}
    {_event(1, 100, 50, "custom-call.3")}
    {_event(3, 160, 4)} }}
  lines {{ id: 9 name: "Stream #9(Kernel)" timestamp_ns: 1000 {_event(4, 80, 40, "loop_add_fusion.1")} }}
  lines {{ id: 10 name: "XLA Ops" timestamp_ns: 1000 {_event(1, 0, 50)} }}
  lines {{ id: 11 name: "CUPTI overhead" timestamp_ns: 1000 {_event(5, 0, 500)} }}
  event_metadata {{ key: 1 value {{ id: 1 name: "nvjet_tst_128x8_64x8_1x1_v_bz_TNT" }} }}
  event_metadata {{ key: 2 value {{ id: 2 name: "tree_attention" }} }}
  event_metadata {{ key: 3 value {{ id: 3 name: "MemcpyD2H" }} }}
  event_metadata {{ key: 4 value {{ id: 4 name: "loop_add_fusion_1" }} }}
  event_metadata {{ key: 5 value {{ id: 5 name: "overhead" }} }}
  stat_metadata {{ key: 1 value {{ id: 1 name: "hlo_op" }} }}
}}
planes {{ id: 2 name: "/host:CPU" lines {{ id: 1 name: "python" timestamp_ns: 0 {_event(1, 0, 9000, "x.1")} }}
  event_metadata {{ key: 1 value {{ id: 1 name: "host op" }} }}
  stat_metadata {{ key: 1 value {{ id: 1 name: "hlo_op" }} }} }}
"""


def test_device_plane_kernels_by_category_and_busy_time():
    plane, events = kp.device_events(jax.profiler.ProfileData.from_text_proto(GPU_XSPACE))
    assert plane == "/device:GPU:0"
    assert sorted(e.name for e in events) == sorted(
        ["nvjet_tst_128x8_64x8_1x1_v_bz_TNT"] * 2 + ["tree_attention", "MemcpyD2H", "loop_add_fusion_1"]
    )
    op_names = {
        "custom-call.3": "jit(f)/while/body/verify/layer0/mlp/dot_general",
        "tree_attention_call": "jit(f)/while/body/verify/layer0/attention/pallas_call",
    }
    s = kp.summarize(events, op_names, wall_s=200e-6, rounds=2)
    # per round: gemm 100 us, attention 30, the fusion 40, the copy 4 (all over 2 rounds)
    assert s["categories_ms_per_round"] == pytest.approx(
        {"gemm": 0.050, "attention:tree_attention": 0.015, "fusion": 0.020, "copy": 0.002}
    )
    assert s["kernel_ms_per_round"] == pytest.approx(0.087)
    # busy: [0,50], then attention 60-90, the other stream's fusion 80-120 and the gemm 100-150 overlap
    # into [60,150], then the copy [160,164]
    assert s["busy_ms_per_round"] == pytest.approx((50 + 90 + 4) / 2 / 1e3)
    assert s["idle_ms_per_round"] == pytest.approx(0.100 - 0.072)
    assert s["scopes_ms_per_round"]["verify/mlp"] == pytest.approx({"gemm": 0.050})
    top = s["top_kernels"][0]
    assert (top["name"], top["calls_per_round"], top["us_per_call"]) == (
        "nvjet_tst_128x8_64x8_1x1_v_bz_TNT",
        1.0,
        50.0,
    )


def test_host_ops_count_self_time_without_their_body():
    """A while op encloses its body's ops on the same host thread: each is counted once."""
    xspace = f"""planes {{ id: 2 name: "/host:CPU"
      lines {{ id: 1 name: "XLAPjRtCpuClient" timestamp_ns: 0
        {_event(1, 0, 100, "while.5")} {_event(2, 10, 30, "dot.1")} {_event(3, 50, 20, "fusion.2")}
        {_event(4, 200, 5)} }}
      event_metadata {{ key: 1 value {{ id: 1 name: "while.5" }} }}
      event_metadata {{ key: 2 value {{ id: 2 name: "dot.1" }} }}
      event_metadata {{ key: 3 value {{ id: 3 name: "fusion.2" }} }}
      event_metadata {{ key: 4 value {{ id: 4 name: "ThreadpoolListener::Record" }} }}
      stat_metadata {{ key: 1 value {{ id: 1 name: "hlo_op" }} }} }}"""
    plane, events = kp.device_events(jax.profiler.ProfileData.from_text_proto(xspace))
    assert plane == "/host:CPU"
    assert {e.name: e.self_ns for e in events} == pytest.approx(
        {"while.5": 50e3, "dot.1": 30e3, "fusion.2": 20e3}
    )
    assert kp.busy_ns(events) == pytest.approx(100e3)


def test_hlo_op_names_give_a_dot_fusion_the_dot():
    def f(a, b):
        with jax.named_scope("mlp"):
            return jnp.tanh(a @ b).sum()

    x = jnp.ones((32, 32))
    names = kp.hlo_op_names(jax.jit(f).lower(x, x).compile().as_text())
    dots = [n for n, op in names.items() if op.endswith("mlp/dot_general")]
    assert dots, names
    assert all(kp.scope_of(names[n]) == "mlp" for n in dots)


def test_cpu_trace_falls_back_to_host_ops(tmp_path):
    def body(_, x):
        with jax.named_scope("mlp"):
            y = jnp.tanh(x @ x)
        return y / jnp.sum(y)

    f = jax.jit(lambda a: jax.lax.fori_loop(0, 3, body, a))
    compiled = f.lower(jnp.ones((128, 128))).compile()
    a = jnp.ones((128, 128))
    jax.block_until_ready(compiled(a))
    data, wall = kp.trace_calls(lambda: compiled(a), 2, str(tmp_path))
    plane, events = kp.device_events(data)
    assert plane == "/host:CPU" and events
    s = kp.summarize(events, kp.hlo_op_names(compiled.as_text()), wall, rounds=2)
    assert 0 < s["busy_ms_per_round"] <= s["wall_ms_per_round"]
    assert s["categories_ms_per_round"].get("gemm", 0) > 0
    assert "mlp" in s["scopes_ms_per_round"]


def test_script_profiles_a_tiny_round(tmp_path):
    out = tmp_path / "profile.json"
    argv = [
        "--shape",
        "tiny",
        "--num-layers",
        "1",
        "--draft-layers",
        "1",
        "--block-size",
        "4",
        "--context",
        "32",
    ]
    argv += ["--methods", "ddtree", "--budgets", "3", "--attention", "reference"]
    argv += ["--programs", "verify,round", "--build-variant", "ranked"]
    try:
        assert kp.main([*argv, "--rounds", "2", "--iters", "1", "--out", str(out)]) == 0
    finally:
        tree.set_default_build(None)
    meta, rows = json.loads(out.read_text())["meta"], json.loads(out.read_text())["rows"]
    assert meta["build_variant"] == "ranked"
    assert [r.get("name") for r in rows] == ["ddtree3_verify", "ddtree3_round"], rows
    for r in rows:
        assert r["plane"] == "/host:CPU"
        assert 0 < r["busy_ms_per_round"] <= r["wall_ms_per_round"]
        assert r["kernels_per_round"] == r["events"] / 2  # 2 rounds, 1 traced call
        assert sum(r["categories_ms_per_round"].values()) == pytest.approx(r["kernel_ms_per_round"])
        times = [k["ms_per_round"] for k in r["top_kernels"]]
        assert times == sorted(times, reverse=True) and len(times) <= 25
    assert any(s.startswith("verify/") for s in rows[1]["scopes_ms_per_round"])
    assert any(s.startswith("build/") for s in rows[1]["scopes_ms_per_round"])
    assert any(s.startswith("walk/") for s in rows[1]["scopes_ms_per_round"])


def test_kernel_without_hlo_op_found_by_its_name():
    """A kernel event without an hlo_op stat (e.g. launched from a CUDA graph) is matched to the
    HLO instruction it is named after."""
    events = [
        kp.KernelEvent("loop_add_fusion_1", "", 0.0, 10e3, 10e3),
        kp.KernelEvent("mystery", "", 10e3, 5e3, 15e3),
    ]
    s = kp.summarize(events, {"loop_add_fusion.1": "jit(f)/verify/layer0/mlp/add"}, 20e-6, rounds=1)
    assert s["scopes_ms_per_round"]["verify/mlp"] == pytest.approx({"fusion": 0.010})
    assert s["categories_ms_per_round"]["other"] == pytest.approx(0.005)
    assert s["no_op_name_ms_per_round"] == pytest.approx(0.005)


def test_top_kernels_merge_one_op_across_layers():
    events = [
        kp.KernelEvent("loop_add_fusion_3", "loop_add_fusion.3", 0.0, 10e3, 10e3),
        kp.KernelEvent("loop_add_fusion_7", "loop_add_fusion.7", 10e3, 12e3, 22e3),
        kp.KernelEvent("loop_add_fusion_9", "loop_add_fusion.9", 22e3, 1e3, 23e3),
    ]
    op_names = {
        "loop_add_fusion.3": "jit(f)/verify/layer0/add",
        "loop_add_fusion.7": "jit(f)/verify/layer1/add",
        "loop_add_fusion.9": "jit(f)/verify/add",
    }
    top = kp.summarize(events, op_names, 30e-6, rounds=1)["top_kernels"]
    assert [(k["name"], k["op_name"], k["scope"], k["calls_per_round"]) for k in top] == [
        ("loop_add_fusion", "jit(f)/verify/layer*/add", "verify/layer_other", 2.0),
        ("loop_add_fusion", "jit(f)/verify/add", "verify/outside_layers", 1.0),
    ]
    assert top[0]["us_per_call"] == pytest.approx(11.0)
