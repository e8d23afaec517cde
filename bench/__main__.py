"""`python -m bench`: the CPU benchmark suite (bench/cpu.py), run from the repository root."""

from bench.cpu import main

main()
