"""The device benchmark's markdown report (benchmarks/device_bench.py measures): ratios, the service against
plain Orbax and against the machine's own limits, with the raw numbers beside them."""

GIB = 2**30
TARGETS = {"realistic": 0.98, "write_bound": 0.95}  # goodput service / plain Orbax (docs/performance.md)


def _fmt(values: list[float]) -> str:
    return ", ".join(f"{v:.3f}" for v in values)


def checkpoint_rows(size: str, r: dict, median) -> tuple[list[str], str]:
    m = {key: median(values) for key, values in r.items() if key not in ("platform", "state_bytes")}
    gib = r["state_bytes"][0] / GIB
    rows = []
    for label, service, plain in (("save() blocking", "service_save.blocking", "orbax_save.blocking"),
                                  ("save -> committed", "service_save.total", "orbax_save.total"),
                                  ("restore", "service_restore.secs", "orbax_restore.secs")):
        rows.append(f"| {size} | {label} | {m[service]:.3f} [{_fmt(r[service])}] | {m[plain]:.3f} [{_fmt(r[plain])}] "
                    f"| {m[service] / m[plain]:.3f} |")
    write_limit = m["device_to_host.secs"] + m["write_fsync.secs"]
    read_limit = m["read_back.secs"] + m["host_to_device.secs"]
    rows.append(f"| {size} | save -> committed / (device -> host + write + fsync) | "
                f"{m['service_save.total'] / write_limit:.3f} | {m['orbax_save.total'] / write_limit:.3f} | - |")
    rows.append(f"| {size} | restore / (read back + host -> device) | {m['service_restore.secs'] / read_limit:.3f} | "
                f"{m['orbax_restore.secs'] / read_limit:.3f} | - |")
    limits = [f"device -> host {gib / m['device_to_host.secs']:.2f} GiB/s", f"write + fsync "
              f"{gib / m['write_fsync.secs']:.2f} GiB/s", f"read back {gib / m['read_back.secs']:.2f} GiB/s"
              f"{'' if min(r['read_back.pages_dropped']) else ' (pages not dropped: a memory read)'}",
              f"host -> device {gib / m['host_to_device.secs']:.2f} GiB/s"]
    parts = ", ".join(f"{key.split(':', 1)[1]} {m[key] * 1e3:.1f} ms" for key in m
                      if key.startswith("service_save.part:"))
    return rows, f"{size} GiB: " + ", ".join(limits) + (f"; the service's save() blocked in {parts}" if parts else "")


def report(results: dict, cadences: dict, median) -> str:
    found = results["devices"]
    lines = [f"Device benchmark on {found['count']} x {found['device_kind']} ({found['backend']}, jax {found['jax']}"
             f", libtpu {found.get('libtpu')}); {results['wall_secs']:.0f} s in all.", ""]
    if "checkpoint" in results:
        lines += ["| GiB | what | service, s | plain Orbax, s | service / plain |", "|---|---|---|---|---|"]
        limits = []
        for size, r in results["checkpoint"].items():
            rows, limit = checkpoint_rows(size, r, median)
            lines += rows
            limits.append(limit)
        lines += ["", "The machine's own limits, same bytes: " + "; ".join(limits) + ".", ""]
    for cadence, runs in results.get("goodput", {}).items():
        steps, every = cadences[cadence]
        ideal, plain = runs["ideal"]["steps_per_sec"], runs["plain_orbax"]["steps_per_sec"]
        lines += [f"Goodput, {cadence} cadence ({steps} steps, a save every {every}):", "",
                  "| variant | steps/s | / no saves | / plain Orbax | save cost / interval | save() blocking, s |",
                  "|---|---|---|---|---|---|"]
        for variant, r in runs.items():
            sps = r["steps_per_sec"]
            blocking = f"{median(r['blocking']):.3f} [{_fmt(r['blocking'])}]" if r["blocking"] else "-"
            lines.append(f"| {variant} | {sps:.2f} | {sps / ideal:.3f} | {sps / plain:.3f} | "
                         f"{ideal / sps - 1:.3f} | {blocking} |")
        target = TARGETS[cadence]
        ratio = runs["service"]["steps_per_sec"] / plain
        met = "met" if ratio >= target else "MISSED"
        lines += ["", f"service / plain Orbax {ratio:.3f} (target >= {target}: {met})", ""]
    if results.get("restart"):
        service, plain = results["restart"]["service"], results["restart"]["plain_orbax"]
        lines += ["Restart with the warm compilation cache (the write-bound runs relaunched), seconds:", "",
                  "| phase | service | plain Orbax | service - plain |", "|---|---|---|---|"]
        for phase in ("open", "compile", "restore", "first_step"):
            if phase in service and phase in plain:
                lines.append(f"| {phase} | {service[phase]:.3f} | {plain[phase]:.3f} | "
                             f"{service[phase] - plain[phase]:+.3f} |")
        lines.append("")
    if "verifier" in results:
        v = results["verifier"]
        pace = [f"{v['proved_steps_per_sec'] / v['train_steps_per_sec']:.3f}",
                f"{v['replayed_steps_per_sec'] / v['train_steps_per_sec']:.3f}",
                f"{v['final_lag_secs']:.1f}" if "final_lag_secs" in v else "none in the grace period"] \
            if "proved_steps_per_sec" in v else ["-"] * 3
        lines += ["The verifier on the host CPU (JAX_PLATFORMS=cpu) following a run on the devices:", "",
                  "| part | proved steps/s / trained | replayed steps/s / trained | final commit -> its verdict, s | "
                  "training with it / alone | complete verdicts |", "|---|---|---|---|---|---|",
                  f"| verifier | {' | '.join(pace)} | {v['with_verifier_steps_per_sec'] / v['alone_steps_per_sec']:.3f}"
                  f" | {v['complete']} of {v['commits']} commits |", "",
                  "Verdicts: " + ", ".join(f"{s}: {x}" for s, x in v["statuses"].items()) + "."]
        if v.get("unverified_steps"):
            lines += ["", "No complete verdict in the grace period: steps "
                      + ", ".join(str(s) for s in v["unverified_steps"]) + "."]
    return "\n".join(lines)
