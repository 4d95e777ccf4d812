"""A busy machine to run the suite beside (issue 47, part 3): two real vLLM
servers (the suite's model, started as `harness.launch_vllm` starts them),
each kept generating by 4 client threads asking 256 tokens at a time, until
interrupted.

On a kernel with `sched_autogroup_enabled` = 1 (this machine's), a task's
nice value weighs only against the tasks of its own session, and each
vLLM server runs in a session of its own. So `nice -n 10` alone leaves each
server as heavy as the whole suite; the servers' priority is set where it
counts, on their sessions' autogroups (`--autogroup-nice`, default 10). On a
kernel without autogroup, the servers' own nice is set instead.

A sleeper in a session of its own (as the suite is) wakes every 10 ms and
records how long it waited for a CPU past that: every 30 s the load prints
its answers so far and the sleeper's worst wait, so a run beside it can be
judged by what the machine gave, not by its load average.

    .venv/bin/python wasm-tests/busy_load.py [--autogroup-nice N] &
    kill %1    # stops the servers too
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

SLEEPER = r"""
import sys, time
worst, last = 0.0, time.monotonic()
while True:
    time.sleep(0.01)
    now = time.monotonic()
    late = now - last - 0.01
    last = now
    if late > worst:
        worst = late
    if late > 0.3:
        print(f"{time.time():.3f} waited {late:.3f} s", flush=True)
"""


def autogroup_enabled() -> bool:
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return False


def set_priority(pid: int, nice: int) -> str:
    if autogroup_enabled():
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
        return Path(f"/proc/{pid}/autogroup").read_text().strip()
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.setpriority(os.PRIO_PROCESS, int(task.name), nice)
    return f"nice {nice} (no autogroup)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--autogroup-nice", type=int, default=10)
    ap.add_argument("--threads", type=int, default=4, help="generating clients per server")
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()
    # A background job ignores SIGINT: `kill` (SIGTERM) stops the load too,
    # through the `finally` below (the servers with it).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    run = harness.fresh_run_dir("busy-load")
    engines = [harness.launch_vllm(f"busy{i}", run) for i in range(2)]
    sleeper_log = run / "sleeper.log"
    sleeper = subprocess.Popen([sys.executable, "-c", SLEEPER], stdout=open(sleeper_log, "w"),
                               start_new_session=True)
    try:
        for e in engines:
            harness.wait_vllm(e)
        # The engine core and its worker are the server's children, in its
        # session: one write covers them.
        for e in engines:
            print(f"vllm {e.name} at {e.url}: {set_priority(e.proc.pid, args.autogroup_nice)}", flush=True)
        answers, errors = [0], [0]

        def client(e, k):
            while True:
                body = json.dumps({"model": harness.VLLM_MODEL, "max_tokens": args.max_tokens, "ignore_eos": True,
                                   "messages": [{"role": "user", "content": f"busy {k} {time.time()} " * 40}]})
                req = urllib.request.Request(e.url + "/v1/chat/completions", data=body.encode(),
                                             headers={"content-type": "application/json"})
                try:
                    urllib.request.urlopen(req, timeout=300).read()
                    answers[0] += 1
                except Exception as ex:  # the load goes on; the count says it faltered
                    errors[0] += 1
                    print(f"load error: {ex!r}", flush=True)
                    time.sleep(1)

        for e in engines:
            for k in range(args.threads):
                threading.Thread(target=client, args=(e, k), daemon=True).start()
        while True:
            time.sleep(30)
            waits = [float(line.split()[2]) for line in sleeper_log.read_text().splitlines() if "waited" in line]
            print(f"{time.strftime('%H:%M:%S')} answers {answers[0]} errors {errors[0]} "
                  f"load {os.getloadavg()[0]:.1f} sleeper waits >0.3 s: {len(waits)}, worst {max(waits, default=0):.2f} s",
                  flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        sleeper.kill()
        for e in engines:
            harness.stop_vllm(e)


if __name__ == "__main__":
    main()
