"""Print every kernel entry's ptxas resources per arch as a Markdown table (no GPU needed).

    python tools/kernel_resources.py

Registers per arch, the entry's register budget (from __launch_bounds__), spill bytes and stack bytes: the
same numbers tests/k3cuda/test_k3cuda_gates.py gates on.
"""
from __future__ import annotations

import k3cuda
from k3cuda.build import ptxas_resources
from k3cuda.spec import ARCHS


def main() -> None:
    print(f"| entry | registers {' / '.join(ARCHS)} | budget | spill bytes / stack bytes |")
    print("|---|---|---|---|")
    for spec in k3cuda.kernel_specs():
        res = {arch: ptxas_resources(spec, arch) for arch in ARCHS}
        for e in spec.entries:
            r = [res[arch][e.name] for arch in ARCHS]
            spills = max(x.spill_stores + x.spill_loads for x in r)
            print(f"| {e.name} | {' / '.join(str(x.registers) for x in r)} | {e.max_registers} | "
                  f"{spills} / {max(x.stack for x in r)} |")


if __name__ == "__main__":
    main()
