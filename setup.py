"""ess_jax: batch-adaptive ESS (P3O) RL post-training of language models in JAX."""

from setuptools import find_packages, setup

# Versions are pinned to what the test suite was run against on the CPU image
# (see the traps in ARCHITECTURE.md: transformers 5.24.0, jax 0.10 mesh semantics).
INSTALL_REQUIRES = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "etils",  # epath, used directly by checkpoint.py (also an orbax dependency)
    "transformers==5.24.0",
    "tokenizers>=0.22",
    "safetensors>=0.6",
    "tensorflow-datasets==4.9.10",
    "array-record>=0.8",
    "importlib-resources",  # tfds needs it without TensorFlow
    "ml-collections==1.1.0",
    "absl-py",
    "numpy>=2.0",
    "gguf==0.19.0",  # GGUF import of llama checkpoints (SmolLM2)
    "math-verify==0.9.0",  # math answer equivalence reward
    "pyarrow",  # parquet inputs of the local dataset builders
    "tqdm",
    "matplotlib",  # reward / ESS curves saved as PNG
    "tensorboardX",  # TensorBoard event files without TensorFlow
    "protobuf",  # rl/metrics.py reads event files back (purge on resume); tensorboardX needs it
    "jinja2>=3.1",  # chat templates: transformers' apply_chat_template imports it lazily
]

# The TPU compiler (libtpu, the `jax[tpu]` extra at the pinned jax): tools/compile_tpu.py
# compiles a run's programs for TPU slices on a CPU host; also what a TPU VM runs with.
TPU_REQUIRES = ["libtpu==0.0.42.1"]

TEST_REQUIRES = [
    "pytest",
    "hypothesis",
    "ruff",
    # the suite on 2 workers (README's command): most of a test is single-threaded compiling,
    # so a 2-core CI machine runs two test files at once
    "pytest-xdist==3.8.0",
    # tests/test_lora.py loads our exported adapter onto the HF base with PEFT (needs torch,
    # which tools/install.sh installs first, the CPU build)
    "peft==0.21.2",
    # tests/test_compile_tpu.py compiles for TPU topologies on the CPU
    *TPU_REQUIRES,
]

setup(
    name="ess_jax",
    version="0.1.0",
    description="Batch-adaptive ESS objective (P3O) and baselines for RL post-training in JAX",
    packages=find_packages(include=["ess_jax", "ess_jax.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require={"test": TEST_REQUIRES, "tpu": TPU_REQUIRES},
)
