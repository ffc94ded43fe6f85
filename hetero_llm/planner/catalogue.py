"""Every constant the planner's cost model prices a device or a link with, and where it comes from. Torch-free.

Each figure is a datasheet number, a published measurement (a matmul or copy benchmark, an NCCL bus bandwidth),
a measurement of this project's own (PUBLISHED.md: the H100's bf16 matmul and copy; the lent H200s'), or an
assumption named as such, with ONE exception: ``SUSTAINED`` (every GPU kind's ``sustained``) is FITTED, to one
published training run (Megatron-LM's GPT 1.7B row, which bench/planner/published.py then reports as the calibration
row, not a check). Nothing else is fitted to a run the model is checked against. docs/planner.md prints the table
(``catalogue_markdown``) and names the fitted constant.

A kind is priced one of two ways (``pricing``): ``"roofline"`` (a real GPU: every operation of a layer at
max(FLOPs / achieved matmul rate at its shape, bytes / achieved memory bandwidth), at least one kernel launch
each) or ``"flops"`` (FLOPs over the kind's ``tflops`` and nothing else: the emulated devices, whose runtime
charges exactly that (predict/device.action_seconds), and the nominal ``cpu`` kind).
"""

from __future__ import annotations

import attrs

from hetero_llm.layout import DomainKind, Precision

ROOFLINE, FLOPS = "roofline", "flops"
PRICINGS = (ROOFLINE, FLOPS)

# FITTED (calibrated) on one published row, which is then no longer a check: Megatron-LM's GPT 1.7B (SC'21 Table 1,
# 137 TFLOP/s per GPU on DGX A100) is matched with every A100 kernel at 0.794 of its benchmark speed (bisection
# in bench/planner/published.py's model; 1.0 predicts 173). The other Megatron rows and Holmes check it. It is applied to
# every GPU kind, one constant for all: at the kernels' benchmark speeds, this project's own H200 runs
# (bench/results/gpu_bench_h200.md: our runtime, a known batch, eager) were predicted at 0.79-0.90 of their measured
# step time, and the published H100 loop's eager rows at 1.16-1.32x their MFU; with it, 0.99-1.13 and 0.92-1.05
# (bench/gpu/gpu_predict.py, bench/planner/published.py). No constant is fitted per kind.
SUSTAINED = 0.794


@attrs.frozen
class KindSpec:
    """One built-in device kind: datasheet figures and achieved ones, each with its source."""

    bf16_tflops: float  # datasheet dense peak, bf16/fp16 tensor cores with fp32 accumulation
    fp32_tflops: float  # datasheet fp32 (no TF32: torch leaves it off for matmuls)
    memory_gb: float
    link_gbps: float  # intra-node link per device and direction (NVLink; PCIe through the host for GeForce)
    mem_bw_gbs: float  # datasheet memory bandwidth
    gemm_fraction: float  # achieved large-matmul TFLOPS / datasheet peak (both precisions)
    attn_fraction: float  # achieved FlashAttention-2 TFLOPS / datasheet peak
    mem_fraction: float  # achieved copy bandwidth / datasheet
    sms: int  # streaming multiprocessors (wave quantization of a matmul's tiles)
    link_fraction: float  # NCCL bus bandwidth / the link's line rate, inside a node
    launch_us: float  # the host's time to launch one kernel (eager PyTorch): a kernel takes at least this
    pricing: str
    source: str
    # FITTED (calibrated), not sourced: the fraction of its isolated-benchmark speed (gemm, attention and memory
    # fractions above) a training step's kernels sustain (SUSTAINED above for every GPU; 1 for the nominal cpu)
    sustained: float = SUSTAINED


# Sources (numbers in docs/planner.md):
#  [DS]   NVIDIA datasheets / whitepapers: A100 (312 TFLOPS bf16, 108 SMs, HBM2e 2039 GB/s (80 GB), 1555 (40 GB),
#         NVLink 3 600 GB/s bidirectional), H100 SXM (989 TFLOPS, 132 SMs, HBM3 3350 GB/s, NVLink 4 900 GB/s),
#         RTX A6000 (84 SMs), RTX 4090 (165.2 TFLOPS fp16/bf16 with fp32 accumulate, 128 SMs), RTX 3090 (71, 82 SMs),
#         RTX 3080 Ti (68.2, 80 SMs).
#  [MAMF] S. Bekman, "Maximum Achievable Matmul FLOPS" (github.com/stas00/ml-engineering,
#         compute/accelerator/README.md): A100 SXM bf16 271.2 TFLOPS (86.9% of 312), H100 SXM 794.5 (80.3%).
#  [H100] PUBLISHED.md, measured 2026-11-22 on one H100 80 GB HBM3: bf16 matmul 767 TFLOPS (77.6% of 989),
#         device copy 2.91 TB/s (86.9% of 3.35).
#  [H200] this project's lent H200 machines (the tool library's KINDS.md, read 2026-10-28 and 2026-11-04): bf16
#         8192^3 matmul 769-798 TFLOPS on random data (788 taken, 79.7% of 989), device copy ~4.3 TB/s counting
#         bytes read and written (89.6% of the datasheet's 4.8); NVIDIA H200 datasheet: 141 GB HBM3e at 4.8 TB/s,
#         the H100's compute and NVLink 4.
#  [A800] github.com/mli/transformers-benchmarks issue 4: A800 80 GB PCIe (the A100's GA100) copy 1727 GB/s of 1935
#         (89.3%).
#  [TPD]  github.com/zzc0721/torch-performance-test-data, issue 78: RTX 4090 bf16 8192^3 matmul 160.2 TFLOPS
#         (97.0% of 165.2); issue 114: RTX 3080 10 GB bf16 10240^3 63.6-64.7 TFLOPS, above its 59.5 datasheet
#         (boost clock): GeForce Ampere reaches its datasheet peak, taken as 1.0 for the 3090 and 3080 Ti.
#  [NCCL] NVIDIA/nccl-tests issue 212 (a maintainer): NVLink's protocol overhead is ~20%, NCCL's effective
#         bus bandwidth 370 of 450 GB/s (0.82); issue 100: 2 HGX A100 with 4 HDR NICs each, all_reduce busbw
#         91 of 100 GB/s (0.91); issue 119: 4 HDR per 8 A100, 84.8-96 of 100 (0.85-0.96).
#  [FA]   FlashAttention-2 (Dao, 2023, abstract): 50-73% of the theoretical maximum FLOPs/s on A100 (the midpoint,
#         0.615, is taken); FlashAttention-3 (Shah et al., 2024, abstract): FlashAttention-2 reaches only 35% on H100.
#         Other kinds: the A100's fraction [ASSUMED].
#  [LAUNCH] "From launch overhead to CUDA Graph" (susun-blog.com/blog/pegainfer-3-cuda-graph): submitting one
#         kernel takes the host about 4-6 us; 5 us is taken.
#  [DISPATCH] github.com/pytorch/pytorch issue 41383: an eager PyTorch op on a tensor that requires grad costs the
#         host ~7 us beyond its kernel (6.8 s for 1 M ``2 * x``; ~5 us without autograd; a maintainer: about half
#         of it Python's). Taken per op of an eager forward (Python, dispatcher, recording the autograd node), on
#         top of the kernel's launch [LAUNCH]; a backward node (C++ autograd engine, no Python) pays the launch only.
#  [CAL]  calibrated on one published row (SUSTAINED below), not a source.
#  [ASSUMED] no published measurement found: stated as an assumption in docs/planner.md.
_A100 = dict(gemm_fraction=271.2 / 312, attn_fraction=0.615, mem_fraction=1727 / 1935, link_fraction=0.82)
_GEFORCE = dict(attn_fraction=0.615, mem_fraction=1727 / 1935, link_fraction=0.8, launch_us=5.0)
_GEFORCE_SOURCE = "DS TPD FA(A100) A800 ASSUMED(PCIe 0.8) LAUNCH"
KINDS: dict[str, KindSpec] = {
    "h100-sxm": KindSpec(
        989.0,
        67.0,
        80.0,
        3600.0,
        3350.0,
        gemm_fraction=767 / 989,
        attn_fraction=0.35,
        mem_fraction=2.91 / 3.35,
        sms=132,
        link_fraction=0.82,
        launch_us=5.0,
        pricing=ROOFLINE,
        source="DS H100 FA NCCL LAUNCH",
    ),
    "h200-sxm": KindSpec(
        989.0,
        67.0,
        141.0,
        3600.0,
        4800.0,
        gemm_fraction=788 / 989,
        attn_fraction=0.35,
        mem_fraction=4.3 / 4.8,
        sms=132,
        link_fraction=0.82,
        launch_us=5.0,
        pricing=ROOFLINE,
        source="DS H200 FA NCCL LAUNCH",
    ),
    "a100-80g": KindSpec(
        312.0,
        19.5,
        80.0,
        2400.0,
        2039.0,
        sms=108,
        **_A100,
        launch_us=5.0,
        pricing=ROOFLINE,
        source="DS MAMF FA A800 NCCL LAUNCH CAL",
    ),
    "a100-40g": KindSpec(
        312.0,
        19.5,
        40.0,
        2400.0,
        1555.0,
        sms=108,
        **_A100,
        launch_us=5.0,
        pricing=ROOFLINE,
        source="DS MAMF FA A800 NCCL LAUNCH CAL",
    ),
    # A6000 (GA102, like the 3090): GeForce Ampere's measured 1.0 [TPD]
    "a6000": KindSpec(
        154.8, 38.7, 48.0, 256.0, 768.0, gemm_fraction=1.0, sms=84, **_GEFORCE, pricing=ROOFLINE, source=_GEFORCE_SOURCE
    ),
    "rtx4090": KindSpec(
        165.2,
        82.6,
        24.0,
        256.0,
        1008.0,
        gemm_fraction=160.2 / 165.2,
        sms=128,
        **_GEFORCE,
        pricing=ROOFLINE,
        source=_GEFORCE_SOURCE,
    ),
    "rtx3090": KindSpec(
        71.0, 35.6, 24.0, 256.0, 936.0, gemm_fraction=1.0, sms=82, **_GEFORCE, pricing=ROOFLINE, source=_GEFORCE_SOURCE
    ),
    "rtx3080ti": KindSpec(
        68.2, 34.1, 12.0, 256.0, 912.0, gemm_fraction=1.0, sms=80, **_GEFORCE, pricing=ROOFLINE, source=_GEFORCE_SOURCE
    ),
    # One CPU process slot of a small VM (the test and testbed clusters): nominal numbers, measured order of
    # magnitude on the 2-core CI machine (a 64-wide matmul runs at a few GFLOPS per core); priced by FLOPs only.
    "cpu": KindSpec(
        0.005,
        0.005,
        8.0,
        40.0,
        10.0,
        gemm_fraction=1.0,
        attn_fraction=1.0,
        mem_fraction=1.0,
        sms=0,
        link_fraction=1.0,
        launch_us=0.0,
        pricing=FLOPS,
        source="nominal",
        sustained=1.0,
    ),
}

# NCCL bus bandwidth / line rate of a network domain's NICs, by cluster.domains[].kind ([NCCL]). RoCE runs
# NCCL's IB verbs transport, taken at InfiniBand's figure [ASSUMED]; Ethernet (NCCL's socket transport over
# TCP) 0.7 [ASSUMED]; 'other' (a vendor plugin) at its declared bandwidth.
DOMAIN_FRACTION: dict[DomainKind, float] = {
    DomainKind.IB: 0.91,
    DomainKind.ROCE: 0.91,
    DomainKind.ETHERNET: 0.7,
    DomainKind.OTHER: 1.0,
}

# A matmul is cut into output tiles of TILE x TILE, one thread block each, run in waves of one block per SM
# (NVIDIA Deep Learning Performance Guide, "Matrix Multiplication Background": tile and wave quantization);
# 128 x 128 is cuBLAS's common large tile there.
TILE = 128
# Host time of one eager PyTorch op beyond its kernel's launch ([DISPATCH]): Python, the dispatcher and the autograd
# node; the host runs ahead of the GPU, so a stage's eager work takes at least its ops' host time.
EAGER_DISPATCH_US = 7.0
# torch DDP's default gradient bucket (bucket_cap_mb = 25): with grad_overlap, the last bucket's all-reduce
# starts only when the backward has ended
DDP_BUCKET_BYTES = 25 * 2**20


def doc(text: str, **kw):
    return attrs.field(metadata={"doc": text}, **kw)


@attrs.frozen
class DeviceKind:
    """``[plan.kinds.NAME]``: one kind of device."""

    tflops: float = doc("peak dense TFLOPS at the training precision (train.precision)")
    memory_gb: float = doc("memory per device, GB (10^9 bytes)")
    link_gbps: float = doc("intra-node link bandwidth per device and direction, Gbit/s (NVLink, PCIe, ...)")
    mem_bw_gbs: float = doc("device memory bandwidth, GB/s (bounds the optimizer step)")
    pricing: str = doc(
        "'roofline': every operation at max(FLOPs / achieved matmul rate at its shape, bytes / achieved memory "
        "bandwidth), at least launch_us each (a GPU); 'flops': FLOPs / tflops only (an emulated device, priced "
        "exactly as the emulated runtime charges it)",
        default=FLOPS,
    )
    gemm_fraction: float = doc("roofline: achieved large-matmul TFLOPS / tflops (measure it)", default=1.0)
    attn_fraction: float = doc(
        "roofline: achieved fused (flash) attention TFLOPS / tflops; 0 = at the large-matmul rate", default=0.0
    )
    mem_fraction: float = doc("roofline: achieved copy bandwidth / mem_bw_gbs", default=1.0)
    sms: int = doc("roofline: streaming multiprocessors (a matmul's wave quantization); 0 = none", default=0)
    link_fraction: float = doc("achieved (NCCL bus) bandwidth / link_gbps inside a node", default=1.0)
    launch_us: float = doc("roofline: the host's time to launch one kernel, microseconds", default=0.0)
    name: str = ""


def catalogue_kind(name: str, precision: Precision) -> DeviceKind:
    k = KINDS[name]
    return DeviceKind(
        k.bf16_tflops if precision is Precision.BF16 else k.fp32_tflops,
        k.memory_gb,
        k.link_gbps,
        k.mem_bw_gbs,
        k.pricing,
        k.gemm_fraction * k.sustained,
        k.attn_fraction * k.sustained,
        k.mem_fraction * k.sustained,
        k.sms,
        k.link_fraction,
        k.launch_us,
        name,
    )


def catalogue_markdown() -> str:
    """The built-in kinds and link efficiencies, for docs/planner.md."""
    rows = [
        "| kind | bf16 TFLOPS | fp32 TFLOPS | achieved matmul | achieved attention | memory GB | memory GB/s | achieved copy | SMs "
        "| link Gbit/s | NCCL link efficiency | launch us | sustained (calibrated) | pricing | sources |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, k in KINDS.items():
        rows.append(
            f"| `{name}` | {k.bf16_tflops:g} | {k.fp32_tflops:g} | {k.gemm_fraction:.3f} | {k.attn_fraction:g} | {k.memory_gb:g} "
            f"| {k.mem_bw_gbs:g} | {k.mem_fraction:.3f} | {k.sms} | {k.link_gbps:g} | {k.link_fraction:g} "
            f"| {k.launch_us:g} | {k.sustained:g} | {k.pricing} | {k.source} |"
        )
    rows += ["", "| network domain kind | NCCL bus efficiency |", "| --- | --- |"]
    rows += [f"| `{d.value}` | {f:g} |" for d, f in DOMAIN_FRACTION.items()]
    return "\n".join(rows) + "\n"
