"""`python -m ess_jax.mismatch --help`: the mismatch command (cli.py)."""

from ess_jax.mismatch.cli import main

if __name__ == "__main__":
    main()
