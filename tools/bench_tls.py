"""TLS benchmark: the binary intake listener with TLS against without it, in one run.

Prints one JSON object per figure on stdout:
    {"bench": "tls", "metric": ..., "value": ..., "unit": ..., ...}

    python tools/bench_tls.py            # the figures of docs/benchmarks.md
    python tools/bench_tls.py --quick    # the same cases, smaller (< 1 minute)

bench_intake's workload and raw client (100-byte bodies, batches of 100, 16 in
flight, sync flush, delays spread over an hour), against ``delayd serve`` in plain TCP
and with ``--tls-cert``/``--tls-key`` (a certificate trustme makes for the run; the
client verifies it), alternating (plain first in even rounds, TLS first in odd ones),
each run on a fresh server and data directory. The server runs on CPU 0 and the client
on CPU 1 (``taskset``). Besides the rates, the server's and the client's CPU time per
message: the TLS share of each side, independent of what else runs on the machine.
One connection carries the whole run, so the handshake is not in the figure; a
handshake costs what ``handshake_cpu`` says (server and client together, in one
process, best of a few hundred).
"""

from __future__ import annotations

import argparse
import resource
import socket
import ssl
import statistics
import tempfile
import threading
import time
from pathlib import Path

import bench_common
import bench_intake
import trustme

emit = bench_common.emitter("tls")
MODES = ("plain", "tls")
HANDSHAKES = 300


def make_certificates(directory: Path) -> tuple[str, str, str]:
    """(CA file, server certificate file, its key file) for 127.0.0.1."""
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    files = [str(directory / name) for name in ("ca.pem", "server.pem", "server.key")]
    ca.cert_pem.write_to_path(files[0])
    server.cert_chain_pems[0].write_to_path(files[1])
    server.private_key_pem.write_to_path(files[2])
    return files[0], files[1], files[2]


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def bench_intake_with_and_without_tls(rounds: int, messages: int, pki: tuple[str, ...]) -> None:
    ca_file, cert_file, key_file = pki
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    server_us: dict[str, list[float]] = {mode: [] for mode in MODES}
    client_us: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_number in range(rounds):
        for mode in MODES if round_number % 2 == 0 else reversed(MODES):
            tls = mode == "tls"
            flags = ("--tls-cert", cert_file, "--tls-key", key_file) if tls else ()
            with tempfile.TemporaryDirectory(prefix="bench-tls-") as data:
                proc, addr = bench_intake.start_delayd(data, extra=flags)
                try:
                    server_before = bench_intake.cpu_seconds(proc.pid)
                    client_before = children_cpu_s()
                    result = bench_intake.run_client(
                        "client", addr, messages, 16, tls_ca=ca_file if tls else None
                    )
                    server_cpu = bench_intake.cpu_seconds(proc.pid) - server_before
                    client_cpu = children_cpu_s() - client_before
                finally:
                    proc.terminate()
                    proc.wait(60)
            acked = result["acked"]
            rates[mode].append(acked / result["seconds"])
            server_us[mode].append(server_cpu / acked * 1e6)
            client_us[mode].append(client_cpu / acked * 1e6)
            emit("acked_throughput", rates[mode][-1], "msg/s", listener=mode,
                 round=round_number, in_flight_batches=16, messages=acked)  # fmt: skip
            emit("server_cpu_per_message", server_us[mode][-1], "us", listener=mode,
                 round=round_number)  # fmt: skip
    for mode in MODES:
        emit("acked_throughput_median", statistics.median(rates[mode]), "msg/s",
             listener=mode, rounds=rounds)  # fmt: skip
        emit("server_cpu_per_message_median", statistics.median(server_us[mode]), "us",
             listener=mode, rounds=rounds)  # fmt: skip
        emit("client_cpu_per_message_median", statistics.median(client_us[mode]), "us",
             listener=mode, rounds=rounds, note="the client process, warm-up included")  # fmt: skip
    ratio = statistics.median(rates["tls"]) / statistics.median(rates["plain"])
    emit("tls_throughput_of_plain", ratio * 100, "%", rounds=rounds)


def bench_handshake(pki: tuple[str, ...]) -> None:
    """CPU of one TLS handshake (server and client sides together), over loopback in
    this process: the cost a new connection adds, which the intake figure leaves out."""
    ca_file, cert_file, key_file = pki
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(cert_file, key_file)
    client_context = ssl.create_default_context(cafile=ca_file)

    def accept(sock: socket.socket) -> None:
        server_context.wrap_socket(sock, server_side=True).close()

    best = float("inf")
    for _ in range(HANDSHAKES):
        left, right = socket.socketpair()
        with left, right:
            started = time.process_time()
            server = threading.Thread(target=accept, args=(right,))
            server.start()
            client_context.wrap_socket(left, server_hostname="127.0.0.1").close()
            server.join()
            best = min(best, time.process_time() - started)
    emit("handshake_cpu", best * 1e6, "us", note="server and client, best of runs",
         runs=HANDSHAKES)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs (< 1 minute)")
    args = parser.parse_args()
    bench_common.emit_host_speed(emit)
    with tempfile.TemporaryDirectory(prefix="bench-tls-pki-") as directory:
        pki = make_certificates(Path(directory))
        bench_handshake(pki)
        if args.quick:
            bench_intake_with_and_without_tls(rounds=4, messages=30_000, pki=pki)
        else:
            bench_intake_with_and_without_tls(rounds=10, messages=200_000, pki=pki)


if __name__ == "__main__":
    main()
