"""Start-up: what an agent imports before it does anything, against the bare interpreter.

Thousands of agents start at once from a venv on a shared file system (or staged to
node-local storage): every module imported at start is read by every node. One run
measures, alternating, --repeat times each:

  python    `python -c pass` (the interpreter's own start-up: the floor)
  agent     `python -c "import cachex_agent.agent, cachex_agent.cli"`: what
            `cachex-agent` imports before it reads its configuration
and lists the heavy packages the agent's import pulls in (scipy and matplotlib must not
be among them: the model's libraries load on first use, in the coordinator only).

    python benchmarks/startup.py [--repeat 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

AGENT = "import cachex_agent.agent, cachex_agent.cli"
HEAVY = ("scipy", "matplotlib", "h5py", "numpy", "psutil", "mpi4py", "xxhash", "zfec")


def timed(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - start


def loaded() -> list[str]:
    probe = f"{AGENT}; import sys; print(' '.join({{m.split('.')[0] for m in sys.modules}}))"
    names = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True,
                           text=True).stdout.split()
    return [h for h in HEAVY if h in names]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    timed(AGENT)        # warm the page cache: both sides then read from memory
    python, agent = [], []
    for _ in range(args.repeat):
        python.append(timed("pass"))
        agent.append(timed(AGENT))
    heavy = loaded()
    results = {"python_s": statistics.median(python), "agent_s": statistics.median(agent),
               "imports": heavy, "model_libraries_loaded": bool({"scipy", "matplotlib"}
                                                                & set(heavy))}
    results["agent_over_python"] = results["agent_s"] / results["python_s"]
    print(f"  python -c pass: median {results['python_s']:.3f} s")
    print(f"  agent imports:  median {results['agent_s']:.3f} s  (heavy packages: "
          f"{', '.join(heavy)})")
    print("ratios")
    print(f"  agent import / bare interpreter: {results['agent_over_python']:.1f}x;"
          f" import alone {results['agent_s'] - results['python_s']:.2f} s;"
          f" scipy/matplotlib loaded at start: {results['model_libraries_loaded']}"
          " (target: False)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
