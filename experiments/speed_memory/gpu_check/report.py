"""A call's results: the e2e rows' ratio to the headline, the summary printed at the end of a call, and
`--report`: several calls of one machine merged into the Markdown tables the README quotes."""
from __future__ import annotations

import json
from pathlib import Path

from experiments.speed_memory.gpu_check.parts import (DS2_LONGEST_S, PARTS, RN, TABLE1, TABLE3, epoch_starts,
                                                      sustained_rate)
from mpt.errors import UserError, one_line

SCHEMA = "gpu_check/1"  # a results file's format: every call writes it, --report reads it


def add_sustained(res: dict) -> None:
    """throughput_sustained (parts.sustained_rate) of the end-to-end rows of a results file written before it
    was recorded, from their windows: epochs of the data's steps (drop_last), windows of e2e_log_every steps."""
    sz = res.get("sizes") or {}
    L, skip = sz.get("e2e_log_every"), sz.get("e2e_skip_windows", 0)
    per_epoch = {"e2e": 12 * sz.get("e2e_train_per_class", 0) // sz.get("headline_batch", 1),
                 "ssd_e2e": sz.get("ssd_images", 0) // sz.get("ssd_batch", 1)}
    for part, spe in per_epoch.items():
        res_ = (res["parts"].get(part) or {}).get("result") or {}
        for r in res_.get("rows") or ([res_["row"]] if res_.get("row") else []):
            w = r.get("windows") or []
            if "throughput_sustained" not in r and w and L and spe:
                r["throughput_sustained"] = sustained_rate(w, epoch_starts([i * L / spe for i in range(len(w) + 1)]),
                                                           skip)


def add_e2e_ratios(res: dict) -> None:
    """ratio_to_synthetic of each end-to-end row: its images/s sustained within epochs over the same call's
    headline row of the same model, precision and layout (synthetic tensors already on the GPU)."""
    add_sustained(res)
    rows = res["parts"].get("headline", {}).get("result", {}).get("rows", [])
    for r in res["parts"].get("e2e", {}).get("result", {}).get("rows", []):
        h = next((x for x in rows if x["precision"] == r["precision"] and x.get("impl") == r["impl"]
                  and x.get("channels_last") == r["channels_last"] and x.get("throughput")), None)
        if h and r.get("throughput_sustained"):
            r["ratio_to_synthetic"] = round(r["throughput_sustained"] / h["throughput"], 3)


def summary_text(res: dict) -> str:
    """The human table: every part's status and time, then its figures."""
    P = res["parts"]
    lines = [f"gpu_check on {res['env'].get('device_name', '?')} ({res['mode']}), {res['date']}", "",
             f"{'part':10s} {'status':8s} {'seconds':>8s} {'budget':>7s}  error / note"]
    for name, p in P.items():
        lines.append(f"{name:10s} {p['status']:8s} {p['seconds']:8.1f} {p['budget_s']:7d}  "
                     + (p.get("error") or p.get("note") or ""))
    lines.append(f"{'total':10s} {'':8s} {res['wall_s']:8.1f} {res['budget_s']:7d}")
    lines += _headline_lines(P.get("headline", {}).get("result", {}))
    worst = ", ".join(f"{m} {s:g} s" for m, s in DS2_LONGEST_S.items())
    for name, title in (("models", "models, paper batch per GPU (size: pixels, or spectrogram frames)"),
                        ("ds2_worst", f"DeepSpeech 2, worst paper batch: paper batch per GPU, longest utterances "
                                      f"({worst}; size in 10 ms frames)")):
        lines += _cell_lines(name, title, P.get(name, {}).get("result", {}))
    lines += _end_to_end_lines(P)
    lines += _cifar_resume_ddp_lines(P)
    return "\n".join(lines)


def _headline_lines(h: dict) -> list[str]:
    """The headline's rows (each precision and layout against strict FP32) and its goals."""
    if not h.get("rows"):
        return []
    lines = ["", f"headline: {RN}, batch {h['options']['batch']}, width {h['options']['width']}, "
                 f"size {h['rows'][0]['size']}",
             f"  {'precision':20s} {'layout':6s} {'status':8s} {'img/s':>9s} {'ms/step':>9s} {'peak MiB':>9s}"
             f" {'GPU busy':>8s} {'speed-up':>8s} {'mem/FP32':>8s}"]
    for r in h["rows"]:
        f = (r.get("ratios") or {}).get("vs_fp32") or {}
        busy = r.get("gpu_busy_fraction")
        prec = r["precision"] + (f" ({r['impl']})" if r.get("impl") else "")
        lines.append(f"  {prec:20s} {'NHWC' if r.get('channels_last') else 'NCHW':6s} {r['status']:8s} "
                     f"{_num(r.get('throughput'), '{:9.0f}')} "
                     f"{_num((r.get('step_ms') or {}).get('median'), '{:9.1f}')} "
                     f"{_num((r.get('peak_gpu_mem_bytes') or 0) / 2**20 or None, '{:9,.0f}')} "
                     f"{_num(busy, '{:8.2f}')} {_num(f.get('speedup'), '{:7.2f}x')} "
                     f"{_num(f.get('peak_gpu_mem'), '{:8.2f}')}")
    lines.append(f"  GPU busy: {h['gpu_busy_fraction_is']}")
    for g in h.get("goals", []):
        lines.append(f"  goal {g['id']}: {g['target']} -> {g['measured']} [{g['status']}]")
    return lines


def _cell_lines(name: str, title: str, m: dict) -> list[str]:
    """The models or ds2_worst part's cells: step time and peak memory (ds2_worst: whether it fits)."""
    if not m.get("rows"):
        return []
    lines = ["", title, f"  {'model':16s} {'precision':26s} {'batch':>5s} {'size':>5s} {'status':7s} "
                        f"{'ms/step':>9s} {'peak MiB':>9s}"
                        + ("  fits (reserved / device)" if name == "ds2_worst" else "")]
    for r in m["rows"]:
        label = f"{r['precision']} {r.get('impl') or ''}".strip() + (" graphs" if r.get("cuda_graphs") else "")
        lines.append(f"  {r['model']:16s} {label:26s} "
                     f"{r['batch']:5d} {r['size']:5d} {r['status']:7s} "
                     f"{_num((r.get('step_ms') or {}).get('median'), '{:9.1f}')} "
                     f"{_num((r.get('peak_gpu_mem_bytes') or 0) / 2**20 or None, '{:9,.0f}')}"
                     + (f"  {r.get('fits')}" + (f" ({r['reserved_of_device']:.0%})" if r.get("reserved_of_device")
                                                 else "") if name == "ds2_worst" else ""))
    return lines


def _end_to_end_lines(P: dict) -> list[str]:
    """The e2e runs (each decode and worker count, against the synthetic rate) and SSD300's run."""
    lines = []
    e = P.get("e2e", {}).get("result", {})
    if e.get("rows"):
        lines += ["", f"end to end: {RN} mixed (autocast, NHWC) from JPEG files, loader workers of {e['cores']} "
                      f"cores; {e['data']['train_images']:,} photographs ({e['data']['sizes']})",
                  f"  {'decode':6s} {'workers':>7s} {'status':10s} {'img/s':>9s} {'x synthetic':>11s} {'median':>7s}  "
                  f"per-window img/s (img/s: sustained within epochs; median: of the windows)"]
        for r in e["rows"]:
            lines.append(f"  {r['decode']:6s} {r.get('num_workers', e['num_workers']):7d} {r['status'] or '-':10s} "
                         f"{_num(r.get('throughput_sustained'), '{:9.0f}')} "
                         f"{_num(r.get('ratio_to_synthetic'), '{:10.2f}x')} {_num(r.get('throughput_steady'), '{:7.0f}')}  "
                         f"{r.get('windows')}")
    r = P.get("ssd_e2e", {}).get("result", {}).get("row")
    if r:
        lines += ["", f"end to end: SSD300 mixed, batch {r['batch']}: {r['status']}, "
                      f"{_num(r.get('throughput_sustained'), '{:.0f}')} img/s sustained within epochs (median window "
                      f"{_num(r.get('throughput_steady'), '{:.0f}')}; windows {r.get('windows')})"]
    return lines


def _cifar_resume_ddp_lines(P: dict) -> list[str]:
    """CIFAR-10's top-1 per precision and seed, then the resume and DDP runs' outcome."""
    lines = []
    c = P.get("cifar", {}).get("result", {})
    if c.get("rows"):
        lines += ["", f"CIFAR-10 real recipe on the GPU ({c['epochs']} epochs), top-1 % per seed:"]
        for cell in _cells(c["rows"]):
            got = [f"{(r.get('metrics') or {}).get('top1', float('nan')):.1f}" for r in c["rows"] if _cell(r) == cell]
            lines.append(f"  {cell:6s} {', '.join(got)}")
    r = P.get("resume", {}).get("result", {})
    if r.get("second"):
        lines += ["", f"resume: stopped at step {r['first']['step']} ({r['first']['status']}), restarted: "
                      f"{r['second']['status']} at step {r['second']['step']}, {r['steps_second']} steps trained "
                      f"after the checkpoint, model on {r['model_device']}"]
    w = P.get("watch", {}).get("result", {})
    for r in w.get("rows", []):
        lines.append(f"\nwatch(every={r['every']}), FP16 autocast + GradScaler, {' '.join(r['overrides']) or 'tiny profile'}: "
                     f"plain {r['step_ms']:.1f} ms a step; a sampled step {r['sampled_cost_ms']:+.2f} ms, a traced one "
                     f"{r['traced_cost_ms']:+.2f} ms: {r['implied_call_pct']:+.1f}% a step")
    r = P.get("ddp", {}).get("result", {})
    if r.get("summary"):
        lines += ["", f"ddp: world size {r['world_size']}: {r['summary']['status']} at step {r['summary']['step']}"]
    return lines


def merge(results: list[dict]) -> dict:
    """Several calls of one machine (a first call and the rerun of what it cut) as one result: each
    part from the last call where it ended ok, else from the one that finished the most rows."""
    def rank(i_rec):
        i, rec = i_rec
        return (rec["status"] in ("ok", "skipped"), len((rec.get("result") or {}).get("rows") or []), i)

    for r in results:
        add_sustained(r)  # (each file with its own sizes, before they merge)
    out = {"env": results[-1]["env"], "date": results[-1]["date"], "mode": results[-1]["mode"], "parts": {},
           "calls": [{"command": r["command"], "date": r["date"], "wall_s": r["wall_s"]} for r in results]}
    for p in PARTS:
        recs = [(i, r["parts"][p]) for i, r in enumerate(results) if p in r["parts"]]
        if recs:
            i, rec = max(recs, key=rank)
            out["parts"][p] = {**rec, "call": i + 1}
    e2e = out["parts"].get("e2e")
    if e2e and e2e.get("result"):
        # Calls that each ran other worker counts (--e2e-workers 7, then 3) add up: every (decode, workers)
        # row, from the last call that measured it; x synthetic against the merged headline.
        rows: dict = {}
        for i, r in enumerate(results):
            for row in ((r["parts"].get("e2e") or {}).get("result") or {}).get("rows") or []:
                rows[(row["decode"], row.get("num_workers"))] = {**row, "call": i + 1}
        e2e["result"] = {**e2e["result"], "rows": sorted(rows.values(), key=lambda x: (-(x.get("num_workers") or 0),
                                                                                         x["decode"]))}
        add_e2e_ratios(out)
    return out


def markdown(res: dict) -> str:
    """The tables the README quotes, from one or more results files (merge)."""
    env, P = res["env"], res["parts"]
    g = env.get("gpu") or {}
    lines = [f"# gpu_check on {env.get('device_name')}", "",
             f"torch {env.get('torch')}, CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}, driver {env.get('driver')}, "
             f"{g.get('sm_count', '?')} SMs, {(g.get('total_memory_bytes') or 0) / 2**30:.0f} GiB. Calls:", ""]
    lines += [f"{i}. `{c['command']}` ({c['date']}, {c['wall_s']} s)" for i, c in enumerate(res["calls"], 1)]
    lines += ["", "| part | status | from call | seconds | limit |", "|---|---|---|---|---|"]
    lines += [f"| {p} | {r['status']} | {r['call']} | {r['seconds']} | {r['budget_s']} |" for p, r in P.items()]
    h = (P.get("headline") or {}).get("result") or {}
    if h.get("rows"):
        lines += ["", f"## ResNet-50 (pre-activation), batch {h['options']['batch']}, 224 px, synthetic data", "",
                  "| precision | layout | images/s | ms/step (median) | peak MiB | GPU busy "
                  "| vs strict FP32 (same layout) | memory / FP32 |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in h["rows"]:
            f = (r.get("ratios") or {}).get("vs_fp32") or {}
            lines.append(f"| {r['precision']}{' (' + r['impl'] + ')' if r.get('impl') else ''} | "
                         f"{'NHWC' if r.get('channels_last') else 'NCHW'} | {_md(r.get('throughput'), '{:,.0f}')} | "
                         f"{_md((r.get('step_ms') or {}).get('median'), '{:.1f}')} | "
                         f"{_md((r.get('peak_gpu_mem_bytes') or 0) / 2**20 or None, '{:,.0f}')} | "
                         f"{_md(r.get('gpu_busy_fraction'), '{:.2f}')} | {_md(f.get('speedup'), '{:.2f}x')} | "
                         f"{_md(f.get('peak_gpu_mem'), '{:.2f}')} |")
        lines += ["", "| goal | target | measured | status |", "|---|---|---|---|"]
        lines += [f"| {x['id']} | {x['target']} | {x['measured']} | {x['status']} |" for x in h.get("goals", [])]
    lines += _end_to_end_md(P)
    for name, title in (("ds2_worst", "DeepSpeech 2 at its worst paper batch (longest utterances: English 35 s, "
                                      "Mandarin 15 s)"),
                        ("models", "Every Table 1 and Table 3 model at the paper grid's batch per GPU")):
        m = (P.get(name) or {}).get("result") or {}
        if not m.get("rows"):
            continue
        lines += ["", f"## {title}", "", "| model | precision | layout | batch | size | status | ms/step | peak MiB |"
                  + (" reserved / device |" if name == "ds2_worst" else ""),
                  "|---|---|---|---|---|---|---|---|" + ("---|" if name == "ds2_worst" else "")]
        for r in m["rows"]:
            lines.append(f"| {r['model']} | {r['precision']}{' (' + r['impl'] + ')' if r.get('impl') else ''}"
                         f"{', CUDA graphs' if r.get('cuda_graphs') else ''} | "
                         f"{'NHWC' if r.get('channels_last') else 'NCHW'} | {r['batch']} | {r['size']} | {r['status']} | "
                         f"{_md((r.get('step_ms') or {}).get('median'), '{:.1f}')} | "
                         f"{_md((r.get('peak_gpu_mem_bytes') or 0) / 2**20 or None, '{:,.0f}')} |"
                         + (f" {_md(r.get('reserved_of_device'), '{:.0%}')} |" if name == "ds2_worst" else ""))
        if name == "models" and P[name]["status"] != "ok":
            done = {r["model"] for r in m["rows"]}
            lines.append(f"\nNot reached in its time limit: {', '.join(x for x in TABLE1 + TABLE3 if x not in done) or '-'}.")
    r = (P.get("resume") or {}).get("result") or {}
    if r.get("second"):
        lines += ["", f"Resume on the device: stopped at step {r['first']['step']} ({r['first']['status']}), restarted: "
                      f"{r['second']['status']} at step {r['second']['step']}, {r['steps_second']} steps trained after "
                      f"the checkpoint, model on {r['model_device']}."]
    w = (P.get("watch") or {}).get("result") or {}
    if w.get("rows"):
        lines += ["", f"## mpt.doctor.watch(every={w['every']}) on a torch.amp loop (FP16 autocast, GradScaler)", "",
                  "| model | plain step, ms | a sampled step adds, ms | a traced one, ms | a step between samples, ms "
                  "| per step at every=10 | rounds x steps |", "|---|---|---|---|---|---|---|"]
        for r in w["rows"]:
            lines.append(f"| {r['model']}{', ' + ' '.join(r['overrides']) if r['overrides'] else ''} | "
                         f"{r['step_ms']:.2f} | {r['sampled_cost_ms']:+.2f} | {r['traced_cost_ms']:+.2f} | "
                         f"{r['between_call_ms']:.3f} (its w.step() call) | {r['implied_call_pct']:+.1f}% | "
                         f"{r['rounds']} x {r['steps']} |")
    if P.get("ddp", {}).get("note"):
        lines += ["", f"DDP: {P['ddp']['status']}: {P['ddp']['note']}."]
    return "\n".join(lines) + "\n"


def _end_to_end_md(P: dict) -> list[str]:
    """The JPEG-file runs: ResNet-50 per decode and worker count against the synthetic rate, SSD300's run,
    and the CIFAR-10 recipe's top-1 per precision and seed."""
    lines = []
    e = (P.get("e2e") or {}).get("result") or {}
    if e.get("rows"):
        hl = (P.get("headline") or {}).get("call", "-")
        lines += ["", f"## {RN} mixed (autocast, NHWC), batch {e['rows'][0].get('batch')}, trained from JPEG files",
                  "", f"{e['data']['train_images']:,} photographs ({e['data']['sizes']}; {e['data']['source']}), "
                      f"loader workers of a {e['cores']}-core machine; images/s: sustained within epochs (the log "
                      f"windows after the first few, those that start an epoch left out: their images over their "
                      f"time); x synthetic: that over the headline's row of the same layout (call {hl}).", "",
                  "| decode | workers | images/s | x synthetic | median window | every log window, min-max | from call |",
                  "|---|---|---|---|---|---|---|"]
        for r in e["rows"]:
            w = r.get("windows") or []
            lines.append(f"| {r['decode']} | {r.get('num_workers', e['num_workers'])} | "
                         f"{_md(r.get('throughput_sustained'), '{:,.0f}')} | {_md(r.get('ratio_to_synthetic'), '{:.2f}')} | "
                         f"{_md(r.get('throughput_steady'), '{:,.0f}')} | "
                         f"{f'{min(w):,.0f}-{max(w):,.0f}' if w else '-'} | {r.get('call', '-')} |")
    r = ((P.get("ssd_e2e") or {}).get("result") or {}).get("row")
    if r:
        lines += ["", f"SSD300 mixed, batch {r['batch']}, trained from VOC-format JPEG files: {r['status']}, "
                      f"{_md(r.get('throughput_sustained'), '{:,.0f}')} images/s sustained within epochs (median "
                      f"window {_md(r.get('throughput_steady'), '{:,.0f}')}; windows {r.get('windows')})."]
    c = (P.get("cifar") or {}).get("result") or {}
    if c.get("rows"):
        lines += ["", f"## CIFAR-10 real recipe ({c['epochs']} epochs), top-1 %", "", "| precision | per seed |",
                  "|---|---|"]
        for cell in _cells(c["rows"]):
            got = [f"{(x.get('metrics') or {}).get('top1', float('nan')):.2f}" for x in c["rows"] if _cell(x) == cell]
            lines.append(f"| {cell} | {', '.join(got)} |")
    return lines


def _cell(row: dict) -> str:
    return row.get("cell", row["precision"])  # (calls before --cifar: the precision alone)


def _cells(rows: list[dict]) -> list[str]:
    """The cifar cells in the order first run."""
    return list(dict.fromkeys(_cell(r) for r in rows))


def _md(v, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def _num(v, fmt: str) -> str:
    if v is None:
        return f"{'-':>{len(fmt.format(0.0))}s}"
    return fmt.format(v)


def write_report(paths: list[Path]) -> int:
    from mpt.rundir import atomic_write_text

    results = []
    for p in paths:
        try:
            r = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"--report {p}: not a readable results file ({one_line(e)})") from None
        if r.get("schema") != SCHEMA:
            raise UserError(f"--report {p}: schema {r.get('schema')!r}, not {SCHEMA} (a gpu_check results file)")
        results.append(r)
    names = {(r.get("env") or {}).get("device_name") for r in results}
    if len(names) > 1:  # (ratios across machines would compare unlike with unlike)
        raise UserError(f"--report: these files come from {len(names)} devices ({', '.join(sorted(map(str, names)))}); "
                        f"merge the calls of one machine at a time")
    md = markdown(merge(results))
    stem = paths[0].name.removesuffix(".json")
    stem = stem[: stem.index("-gpu_check") + len("-gpu_check")] if "-gpu_check" in stem else stem
    dest = paths[0].with_name(stem + ".md")
    atomic_write_text(dest, md)
    print(md + f"\nwrote {dest}")
    return 0

