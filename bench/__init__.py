"""The benchmark suite: ess_jax against its PyTorch peers, side by side in one run.

  python -m bench               the CPU suite (cpu.py): matmul ceiling, train step, sampler,
                                one RL step taken apart; writes BENCHMARKS.md
  python -m bench.gpu           the same at Qwen2.5-1.5B's dimensions, for an NVIDIA GPU
  python -m bench.gpu_lower     lowers the GPU bench's programs for CUDA on any machine and
                                counts the cuDNN attention calls

Run from the repository root (it is not installed with ess_jax). Shared parts: common.py
(sizes, FLOP counts, timing), train.py / decode.py / rl.py (one section each), report.py and
gpu_report.py (tables and headline ratios). BENCHMARKS.md: the CPU figures (its generated
part) and the design decisions with their measurements (hand-written, kept by every run).
"""
