"""The "beyond the paper" table: every model of the paper's tables (one row each) in the low-precision
formats of its successors, beside FP32 and the paper's own mixed precision. Each experiment's row reads
its own metric (the spec of its table in specs.TABLES); Δ is against the row's FP32 cell, within seed noise
or not (tables.Cell.vs_ref_text), since the paper has no numbers for these formats. A cell whose runs
measured how far their gradients are from FP32's (numerics.sqnr_every) also shows that SQNR, the formats'
numerics apart from the metric.

Under it, a format recipe's switches (grid_switches.yaml): where runs flipped fmt.* keys of a preset
("nvfp4 fmt.w.granularity=nvfp4_16"), each such model gets a table of its own -- FP32, the presets, and one
row per recipe labelled by the keys that differ from its preset, with Δ against FP32 and against the preset
and the SQNR -- the committed results' table (paper_tables.committed.table) of the same runs."""
from __future__ import annotations

import csv
import dataclasses
import html
import io
import math
import statistics

from mpt import precisions
from paper_tables import committed, results, specs, tables



def _header(c) -> str:
    """A column's header: its label without the "beyond the paper" prefix and the first/last-layers note
    ("row-wise FP8 (torchao)")."""
    return c.label.removeprefix("beyond the paper: ").split(", BF16 first/last")[0]


# (column id, header): a run's column is its precision's column (results.run_precision), except the
# paper's MP, which is whichever precision fills that table's MP column (tables.paper_column: mixed or
# fp16 with S = 1, Table 3's fp16_storage). Then the first column of every precision beyond the paper, in
# the table's order: a precision row added to mpt/precisions.py gets its column here.
COLUMNS = (("fp32", "FP32"), ("mp", "the paper's MP"),
           *((p.columns[0].name, _header(p.columns[0])) for p in precisions.TABLE if p.beyond_paper))


@dataclasses.dataclass
class BeyondTable:
    profile: str
    rows: list  # (table spec, model, label)
    cells: dict  # (spec id, model, column id) -> tables.Cell
    n_runs: int
    sqnr: dict = dataclasses.field(default_factory=dict)  # (spec id, model, column id) -> [each run's SQNR]
    switches: list = dataclasses.field(default_factory=list)  # (table spec, model, results lines: switches())

    def sqnr_db(self, key) -> float | None:
        """The cell's gradient SQNR: the median over its runs that measured one (results.run_sqnr)."""
        vals = self.sqnr.get(key)
        return statistics.median(vals) if vals else None

    def sqnr_text(self, key) -> str:
        v = self.sqnr_db(key)
        return "" if v is None or math.isinf(v) else f"{v:.1f} dB"

    @property
    def stem(self) -> str:
        return "beyond_paper" + specs.profile_suffix(self.profile)

    title = "Beyond the paper: the paper's models in today's low-precision formats"


def column_of(run, spec: specs.TableSpec) -> str | None:
    prec, _, _, tf32 = run.variant
    if prec == "fp32":
        return None if tf32 else "fp32"
    if tables.paper_column(run.variant, spec.paper["columns"]) in ("mp", "mp_scale"):
        return "mp"
    return prec if prec in dict(COLUMNS) else None


def build(runs: list, profile: str, problems: list) -> BeyondTable:
    rows, cells, n, sqnr, switches = [], {}, 0, {}, []
    for spec in specs.TABLES:
        mine = [r for r in runs if r.experiment == spec.experiment and r.profile == profile]
        for row in spec.paper["rows"]:
            rows.append((spec, row["model"], row["label"]))
            for c, _ in COLUMNS:
                cells[(spec.id, row["model"], c)] = tables.Cell(spec.decimals, comparable=False)
            for c, _ in COLUMNS:
                if c != "fp32":
                    cells[(spec.id, row["model"], c)].ref = cells[(spec.id, row["model"], "fp32")]
        for r in mine:
            key = (spec.id, r.model, column_of(r, spec))
            cell = cells.get(key)
            if cell is not None:
                n += 1
                tables.add_run(cell, r, spec, problems)
                db = results.run_sqnr(r, problems)
                if db is not None:
                    sqnr.setdefault(key, []).append(db)
        for model in sorted({r.model for r in mine if " fmt." in r.precision}):
            switches.append((spec, model, [committed.record(r, None, {}) for r in mine
                                           if r.model == model and _in_switches(r)]))
    return BeyondTable(profile, rows, cells, n, sqnr, switches)


def _in_switches(run) -> bool:
    """A run of a model's switches table: FP32 (no TF32), or a simulated format's preset or switched recipe."""
    prec = run.precision.split()[0]  # the column: fp8_delayed, nvfp4_all (fp8.ends=fp8), ...
    return (prec == "fp32" and not run.tf32) or prec.removesuffix("_all") in precisions.GROUPS["formats"] \
        or prec.startswith("fp8_")


def _metric(spec) -> str:
    return f"{spec.metric[0]} ({'higher' if spec.higher_is_better else 'lower'} is better)"


def _ours(t: BeyondTable, key) -> str:
    """The cell's mean ± std (n), and its gradient SQNR where its runs measured one."""
    db = t.sqnr_text(key)
    return t.cells[key].ours_text() + (f"; {db}" if db else "")


def to_markdown(t: BeyondTable) -> str:
    out = [f"# {t.title}", ""]
    if specs.profile_label(t.profile):
        out += [f"> **{specs.profile_label(t.profile)}**", ""]
    out += ["Rows: the models of the paper's tables, each with its own metric; mean ± sample std over seeds "
            "(n). Δ: ours − the row's FP32, within seed noise when |Δ| <= 2 standard errors. The formats are "
            "simulated (mpt/formats.py): numerics, not speed. FP8: per-tensor delayed scaling, BF16 first "
            "and last layers (grid_fp8.yaml); block FP8, MXFP8, NVFP4: grid_formats.yaml with BF16 ends; "
            "BF16 without a master copy: round to nearest (grid_bf16_pure.yaml). dB: the gradients' SQNR against "
            "FP32 on the same weights and batch, where the runs measured it (numerics.sqnr_every): the median "
            "over sampled steps of the median over parameters, its median over seeds; under 20 dB is far.", ""]
    head = ["Model", "metric"] + [x for c, label in COLUMNS for x in ((label,) if c == "fp32" else (label, "Δ"))]
    out.append("| " + " | ".join(head) + " |")
    out.append("|---|---|" + "---:|" * (len(head) - 2))
    for spec, model, label in t.rows:
        line = [label, _metric(spec)]
        for c, _ in COLUMNS:
            key = (spec.id, model, c)
            line += [_ours(t, key)] if c == "fp32" else [_ours(t, key), t.cells[key].diff_text()]
        out.append("| " + " | ".join(tables._md(x) for x in line) + " |")
    out += ["", f"{t.n_runs} run(s) behind this table.", ""]
    for spec, model, lines in t.switches:
        body, sqnr = committed.table(lines)
        out += [f"## {model}: a format recipe's switches, one at a time", "",
                f"{spec.experiment}, {model}: FP32, the presets, and each preset with the fmt.* keys of its column "
                "flipped (grid_switches.yaml); Δ vs preset: against the column without those keys"
                + (f"; {committed.SQNR_NOTE}" if sqnr else "") + ".", "", *body, ""]
    return "\n".join(out)


def to_csv(t: BeyondTable) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["profile", "table", "model", "label"] + [f"{c}|{f}" for c, _ in COLUMNS
                                                          for f in ("ours_mean", "ours_std", "n", "status", "diff_text",
                                                                    "sqnr_db")])
    for spec, model, label in t.rows:
        row = [t.profile, spec.id, model, label]
        for c, _ in COLUMNS:
            cell, db = t.cells[(spec.id, model, c)], t.sqnr_db((spec.id, model, c))
            row += ["" if cell.mean is None else repr(cell.mean), "" if cell.std is None else repr(cell.std),
                    cell.n, cell.status, cell.diff_text(), "" if db is None else repr(db)]
        w.writerow(row)
    return buf.getvalue()


def to_html(t: BeyondTable) -> str:
    e = html.escape
    out = [f'<section class="table" id="{e(t.stem)}"><h3>{e(t.title)}</h3>',
           '<table class="results"><tr><th>Model</th><th>metric</th>']
    out += [f"<th>{e(label)}</th>" + ("" if c == "fp32" else "<th>Δ</th>") for c, label in COLUMNS]
    out.append("</tr>")
    for spec, model, label in t.rows:
        out.append(f"<tr><td>{e(label)}</td><td>{e(_metric(spec))}</td>")
        for c, _ in COLUMNS:
            cell = t.cells[(spec.id, model, c)]
            out.append(f'<td class="ours {e(cell.status)}">{e(_ours(t, (spec.id, model, c)))}</td>'
                       + ("" if c == "fp32" else f"<td>{e(cell.diff_text())}</td>"))
        out.append("</tr>")
    out.append("</table>")
    for _, model, lines in t.switches:  # the Markdown table as preformatted text: one renderer for both
        out.append(f"<h4>{e(model)}: a format recipe's switches, one at a time</h4>"
                   f"<pre>{e(chr(10).join(committed.table(lines)[0]))}</pre>")
    out.append("</section>")
    return "\n".join(out)
