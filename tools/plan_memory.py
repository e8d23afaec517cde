"""Per-device memory of a run before launching it, and whether it fits the device.

    python tools/plan_memory.py --config=configs/paper/e1_clip_sweep.py:p3o,v5p-8
    python tools/plan_memory.py --config=configs/quickstart.py --device=h100 --num_devices=1
    python tools/plan_memory.py --config=configs/paper/e5_fp8.py:p3o --mesh=fsdp=4,tensor=2

Prints the resident buffers (params, AdamW state, policy history, external model), each phase's
transients (train step, sampling, eval, history push) and, on the last line, the peak and
whether it fits. The device and device count come from the preset named after the arm
(`8xh100`, `8xh200`, `v5p-8`, `v5e-16`; the paper configs default to 8xh100) or from
--device / --num_devices. Runs on the CPU, allocates nothing:
shapes only (ess_jax/memory/planner.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # config files import configs.*
    sys.path.insert(0, ROOT)

from ess_jax.config import presets  # noqa: E402
from ess_jax.memory import planner as memory  # noqa: E402


def load_config(spec: str):
    """--config=FILE[:ARG] as ess_jax.main reads it (ARG goes to get_config)."""
    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(mod)
    return mod.get_config(arg or None)


def parse_mesh(text: str) -> dict:
    """'fsdp=4,tensor=2' -> {'fsdp': 4, 'tensor': 2}."""
    out = {}
    for item in text.split(","):
        axis, _, size = item.partition("=")
        out[axis.strip()] = int(size)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="FILE[:ARM[,PRESET]]")
    p.add_argument("--mesh", help="mesh override, e.g. fsdp=4,tensor=2 (default: the config's)")
    p.add_argument("--device", help=f"device kind: {', '.join(presets.HBM)}")
    p.add_argument("--num_devices", type=int, help="devices in the mesh")
    args = p.parse_args(argv)
    config = load_config(args.config)
    preset = args.config.partition(":")[2].split(",")[-1]
    preset = presets.PRESETS.get(preset) or (
        presets.PRESETS[presets.DEFAULT] if "configs/paper/" in args.config else None
    )
    device = args.device or (preset.device if preset else None)
    num_devices = args.num_devices or (preset.num_devices if preset else None)
    if device is None or num_devices is None:
        p.error("name a preset after the arm (FILE:ARM,PRESET) or give --device and --num_devices")
    mesh = parse_mesh(args.mesh) if args.mesh else None
    plan = memory.plan(config, num_devices, device, mesh)
    print("\n".join(plan.lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
