"""Tables 1-3: runs -> cells (mean +- std over seeds beside the paper's number) -> Markdown, LaTeX
(booktabs), CSV and an HTML fragment. Shaped like the paper's tables: rows the models, columns the
precisions (the paper's columns first, then every other precision our runs used)."""
from __future__ import annotations

import collections
import csv
import dataclasses
import html
import io
import math
import re
import statistics

from mpt import precisions
from paper_tables import specs
from paper_tables.results import Problem, RunResult

# Statuses other than completed, in the order a cell names them.
OTHER_ORDER = ("running", "interrupted", "diverged", "failed", "no_metric")
OTHER_LABEL = {"no_metric": "completed without metric"}
# What an unrun paper column would be run as (section 4's three modes).
PLACEHOLDER = {"fp32": ("fp32", None, None, False), "mp_noscale": ("fp16", None, 1, False),
               "mp_scale": ("mixed", None, None, False), "mp": ("fp16", None, 1, False)}
# Table 1 has one MP column, and the paper ran it without loss scaling (4.1): an empty table's MP column
# is our fp16 (S = 1), as the experiment's README says. A column that names its precisions
# (paper_numbers.yaml `precisions:`, Table 3's fp16_storage) has the first of them instead.


@dataclasses.dataclass
class Column:
    id: str
    label: str
    paper_key: str | None
    variant: tuple
    placeholder: bool = False  # no run of this paper column yet


@dataclasses.dataclass
class Cell:
    decimals: int
    paper: object = None  # a number, "diverges", or None (not in the paper)
    comparable: bool = True  # False for non-paper profiles: no difference is computed
    values: list = dataclasses.field(default_factory=list)
    others: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    progress: list = dataclasses.field(default_factory=list)  # (step, total) of running runs
    runs: list = dataclasses.field(default_factory=list)
    # In a non-paper profile the paper's number is not comparable; the row's FP32 cell is, and Δ then
    # says whether this precision agrees with FP32 within seed noise (Table 1's claim at any scale).
    ref: "Cell | None" = None
    ref_name: str = "FP32"  # what ref is, in the Δ text: FP32, or the preset a recipe's switch is flipped from

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.values) if self.values else None

    @property
    def std(self) -> float | None:
        # Sample standard deviation over seeds; undefined for one seed.
        return statistics.stdev(self.values) if len(self.values) > 1 else None

    @property
    def diff(self) -> float | None:
        if not self.comparable or self.mean is None or not _is_number(self.paper):
            return None
        return self.mean - float(self.paper)

    @property
    def status(self) -> str:
        if self.values:
            return "partial" if self.others else "ok"
        for s in OTHER_ORDER:
            if self.others[s]:
                return s
        return "missing"

    def _fmt(self, x: float) -> str:
        return f"{x:.{self.decimals}f}"

    def ours_text(self, pm: str = "±") -> str:
        others = [f"{self.others[s]} {OTHER_LABEL.get(s, s)}" for s in OTHER_ORDER if self.others[s]]
        if self.values:
            core = self._fmt(self.mean) + (f" {pm} {self._fmt(self.std)}" if self.std is not None else "")
            return f"{core} (n={self.n}" + (f"; {', '.join(others)}" if others else "") + ")"
        parts = []
        for s in OTHER_ORDER:
            k = self.others[s]
            if not k:
                continue
            label = OTHER_LABEL.get(s, s)
            if s in ("running", "interrupted"):
                prog = ", ".join(f"{a if a is not None else '?'}/{b if b is not None else '?'}"
                                 for st, a, b in self.progress if st == s)
                parts.append(f"{label} ({prog})")
            else:
                parts.append(label + (f" ({k} seeds)" if k > 1 else ""))
        return "; ".join(parts) or "not run"

    def paper_text(self) -> str:
        if self.paper is None:
            return "—"
        return self._fmt(float(self.paper)) if _is_number(self.paper) else str(self.paper)

    def diff_text(self) -> str:
        if self.paper == "diverges":
            if not self.values and self.others["diverged"]:
                return "both diverge"
            return "paper diverges" if self.values else "—"
        if not self.comparable and self.values and self.ref is not None and self.ref.values:
            return self.vs_ref_text()
        if not self.comparable and self.values and _is_number(self.paper):
            return "n/c"
        d = self.diff
        return "—" if d is None else f"{d:+.{self.decimals}f}"


    def vs_ref_text(self) -> str:
        """Ours minus the row's FP32 mean (or ref_name's), and whether that is within seed noise: |Δ| <= 2
        standard errors of the difference (sqrt(s1²/n1 + s2²/n2)); with fewer than 2 seeds on a side, no test."""
        d = self.mean - self.ref.mean
        text = f"{d:+.{self.decimals}f} vs {self.ref_name}"
        if self.std is None or self.ref.std is None:
            return text + " (n<2: no test)"
        se = math.sqrt(self.std ** 2 / self.n + self.ref.std ** 2 / self.ref.n)
        return text + (" (within seed noise)" if abs(d) <= 2 * se else " (DIFFERS: > 2 SE)")


@dataclasses.dataclass
class Table:
    spec: specs.TableSpec
    profile: str
    rows: list  # (model, label)
    columns: list[Column]
    cells: dict  # (model, column id) -> Cell
    env: list[str]
    problems: list[Problem]
    n_runs: int

    @property
    def stem(self) -> str:
        return self.spec.id + specs.profile_suffix(self.profile)

    @property
    def title(self) -> str:
        if not re.fullmatch(r"table\d+", self.spec.id):  # the final_* tables: not the paper's
            return self.spec.paper["title"]
        num = re.sub(r"\D", "", self.spec.id)
        return f"Table {num}: {self.spec.paper['title']}"

    @property
    def label(self) -> str | None:
        return specs.profile_label(self.profile)

    def intro(self) -> str:
        s, p = self.spec, self.spec.paper
        better = "higher" if s.higher_is_better else "lower"
        return (f"Paper section {p['section']} (confidence {p['confidence']}). Ours: "
                f"`metrics.{s.metric[0]}` of experiment `{s.experiment}`, profile `{self.profile}`, "
                f"{better} is better; mean ± sample std over seeds, n = seeds; "
                + ("Δ = ours − paper." if self.profile == "paper" else
                   "Δ = ours − this row's FP32 (the paper's numbers are not comparable at this scale)."))

    def fill_command(self) -> str:
        """What fills this table's cells: its experiment's grid in this profile (experiments/<name>/grid*.yaml
        hold the rest: Table 1's batch-32 nets, the formats beyond the paper)."""
        e, p = self.spec.experiment, self.profile
        backend = "--backend slurm --cluster <name>" if p == "paper" else "--backend local"
        cmd = f"`python -m slurm.submit experiments/{e}/grid.yaml --profile {p} {backend}` (`--only model=M` for one row)"
        if p == "tiny":  # the demo runs a chosen subset of the tiny grids
            cmd += "; `python -m experiments --full` runs every tiny grid of every experiment"
        return cmd

    def records(self) -> list[dict]:
        """The table as plain data (what the CSV holds)."""
        out = []
        for model, label in self.rows:
            cells = {}
            for c in self.columns:
                cell = self.cells[(model, c.id)]
                cells[c.id] = {"ours_mean": cell.mean, "ours_std": cell.std, "n": cell.n,
                               "status": cell.status, "ours_text": cell.ours_text("+-"),
                               "paper": cell.paper, "diff": cell.diff, "diff_text": cell.diff_text()}
            out.append({"profile": self.profile, "model": model, "label": label, "cells": cells})
        return out


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def variant_key(v):
    prec, impl, scale, tf32 = v
    rank = specs.PRECISION_ORDER.index(prec) if prec in specs.PRECISION_ORDER else len(specs.PRECISION_ORDER)
    s = (0, float(scale), "") if _is_number(scale) else (1, 0.0, str(scale))
    return (rank, prec, bool(tf32), s, str(impl))


def paper_column(variant, columns: list[dict]) -> str | None:
    """Our precision -> the paper's column. A column that names its precisions (`precisions:` in
    paper_numbers.yaml) takes those and nothing else: Table 3's MP is fp16_storage, the paper's "FP16
    storage, FP32 math" (4.3). Otherwise fp32 (TF32 off) -> FP32; fp16 or S = 1 -> MP without loss
    scaling; mixed -> MP with loss scaling. Table 1's one MP column is the paper's run without loss scaling
    (4.1), so it takes fp16 / S = 1 only: a mixed run with S > 1 or dynamic S is an extra column there."""
    prec, _, scale, tf32 = variant
    for c in columns:
        if prec in c.get("precisions", ()):
            return c["key"]
    keys = [c["key"] for c in columns if "precisions" not in c]
    if prec == "fp32":
        return "fp32" if not tf32 and "fp32" in keys else None
    if prec == "fp16" or (prec == "mixed" and scale == 1):
        return next((k for k in ("mp_noscale", "mp") if k in keys), None)
    if prec == "mixed":
        return "mp_scale" if "mp_scale" in keys else None
    return None


def _describe(variant, multi_impl: bool) -> str:
    prec, impl, scale, tf32 = variant
    parts = [prec + ("+TF32" if tf32 and prec == "fp32" else "")]
    if scale is not None:
        parts.append(f"S={scale}")
    if tf32 and prec != "fp32":
        parts.append("TF32")
    if multi_impl and impl:
        parts.append(f"impl={impl}")
    return ", ".join(parts)


def _slug(variant, multi_impl: bool) -> str:
    prec, impl, scale, tf32 = variant
    s = prec + (f"_S{scale}" if scale is not None else "") + ("_tf32" if tf32 else "")
    s += f"_{impl}" if multi_impl and impl else ""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", s)


def env_lines(runs: list[RunResult]) -> list[str]:
    """The environments behind a table, one line per distinct one, with how many runs used it."""
    count = collections.Counter()
    for r in runs:
        e = r.env or {}
        dev = e.get("device_name") or "no GPU recorded (CPU)"
        ws = e.get("world_size")
        parts = [f"{ws}x {dev}" if isinstance(ws, int) and ws > 1 else str(dev)]
        vers = [f"{k} {e[k]}" for k in ("torch", "torchvision", "python") if e.get(k)]
        if "cuda" in e:
            vers.append(f"CUDA {e['cuda'] or 'none'}")
        if vers:
            parts.append(", ".join(vers))
        if "tf32_matmul" in e or "tf32_cudnn" in e:
            on = lambda k: "?" if e.get(k) is None else ("on" if e.get(k) else "off")  # noqa: E731
            parts.append(f"TF32 matmul {on('tf32_matmul')}, cuDNN {on('tf32_cudnn')}")
        if e.get("git_commit"):
            parts.append(f"git {str(e['git_commit'])[:10]}" + (" (dirty)" if e.get("git_dirty") else ""))
        count["; ".join(parts)] += 1
    return [f"{n} run{'s' if n > 1 else ''}: {desc}" for desc, n in sorted(count.items(), key=lambda x: -x[1])]


def build_table(spec: specs.TableSpec, runs: list[RunResult], profile: str,
                problems: list[Problem]) -> Table:
    paper = spec.paper
    mine = [r for r in runs if r.experiment == spec.experiment and r.profile == profile]
    rows = [(row["model"], row["label"]) for row in paper["rows"]]
    paper_vals = {row["model"]: row for row in paper["rows"]}
    # A model the paper did not have still gets a row (its paper cells say so).
    rows += [(m, m) for m in sorted({r.model for r in mine} - {m for m, _ in rows})]

    # Columns from every profile's runs of this experiment, so the paper-profile table and the tiny
    # one have the same columns (a variant with no run in this profile shows as missing).
    variants = sorted({r.variant for r in runs if r.experiment == spec.experiment}, key=variant_key)
    multi_impl = len({v[1] for v in variants}) > 1
    columns = []
    for pc in paper["columns"]:
        vs = [v for v in variants if paper_column(v, paper["columns"]) == pc["key"]]
        for v in vs:
            columns.append(Column(_slug(v, multi_impl), f"{pc['label']} ({_describe(v, multi_impl)})",
                                  pc["key"], v))
        if not vs:
            v = ((pc["precisions"][0], None, None, False) if pc.get("precisions")
                 else PLACEHOLDER.get(pc["key"], ("fp32", None, None, False)))
            columns.append(Column(_slug(v, False), f"{pc['label']} ({_describe(v, False)})", pc["key"],
                                  v, placeholder=True))
    for v in variants:
        if paper_column(v, paper["columns"]) is None:
            col = precisions.column(v[0], tf32=v[3])  # FP32 with TF32 on is the TF32 baseline's column
            name = col.label if col else v[0]
            columns.append(Column(_slug(v, multi_impl), f"{name} ({_describe(v, multi_impl)})", None, v))

    comparable = profile == "paper"
    cells = {}
    for model, _ in rows:
        for c in columns:
            pv = paper_vals.get(model, {}).get(c.paper_key) if c.paper_key else None
            cells[(model, c.id)] = Cell(spec.decimals, paper=pv, comparable=comparable)
    if not comparable:
        ref_col = next((c.id for c in columns if c.paper_key == "fp32" and not c.placeholder), None)
        for model, _ in rows:
            for c in columns:
                if ref_col is not None and c.id != ref_col:
                    cells[(model, c.id)].ref = cells[(model, ref_col)]
    col_of = {c.variant: c.id for c in columns if not c.placeholder}
    for r in mine:
        add_run(cells[(r.model, col_of[r.variant])], r, spec, problems)
    mine_problems = [p for p in problems if p.experiment == spec.experiment and p.profile in (profile, None)]
    return Table(spec, profile, rows, columns, cells, env_lines(mine), mine_problems, len(mine))


def add_run(cell: Cell, r: RunResult, spec: specs.TableSpec, problems: list[Problem]) -> None:
    """Run r into its cell: its metric where it completed with one, else its status."""
    cell.runs.append(r.where)
    if r.status == "completed":
        value = next((r.metrics[k] for k in spec.metric if k in r.metrics), None)
        if _is_number(value) and math.isfinite(value):
            cell.values.append(float(value) * spec.metric_scale)
        else:
            cell.others["no_metric"] += 1
            problems.append(r.problem(f"completed, but metrics.{spec.metric[0]} is "
                                      f"{'absent' if value is None else repr(value)}; not averaged"))
    else:
        cell.others[r.status] += 1
        if r.status in ("running", "interrupted"):
            cell.progress.append((r.status, r.step, r.total_steps))


# ----------------------------------------------------------------------------- Markdown
def _md(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def to_markdown(t: Table) -> str:
    out = [f"# {t.title}", ""]
    if t.label:
        out += [f"> **{t.label}**", ""]
    out += [t.intro(), ""]
    head = ["Model"] + [x for c in t.columns for x in (c.label, "paper", "Δ")]
    out.append("| " + " | ".join(_md(h) for h in head) + " |")
    out.append("|" + "---|" + "---:|---:|---:|" * len(t.columns))
    for model, label in t.rows:
        row = [label]
        for c in t.columns:
            cell = t.cells[(model, c.id)]
            row += [cell.ours_text(), cell.paper_text(), cell.diff_text()]
        out.append("| " + " | ".join(_md(x) for x in row) + " |")
    if any(c.status == "missing" for c in t.cells.values()):
        out += ["", f"Cells `not run` have no run of this profile under the run directories read: "
                    f"{t.fill_command()}."]
    out += ["", "Paper notes:"] + [f"- {n}" for n in t.spec.paper.get("notes", [])]
    out += ["", f"Environment of the {t.n_runs} run(s) behind this table:"]
    out += [f"- {e}" for e in t.env] or ["- (no runs yet)"]
    out += ["", "Skipped or questionable results:"]
    out += [f"- `{p.where}`: {p.what}" for p in t.problems] or ["- none"]
    out += ["", "Status markers: see paper_tables/README.md (not run, running (step/total), "
            "interrupted, diverged, failed, completed without metric, n/c = not comparable). In a "
            "non-paper profile Δ compares with the row's FP32 cell instead of the paper: within seed noise "
            "when |Δ| <= 2 standard errors of the difference.", ""]
    return "\n".join(out)


# ----------------------------------------------------------------------------- LaTeX
_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
        "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
        "±": r"$\pm$", "Δ": r"$\Delta$", "−": "$-$", "—": "---", "–": "--", "×": r"$\times$",
        "<": r"\textless{}", ">": r"\textgreater{}"}


def tex_escape(s) -> str:
    out = "".join(_TEX.get(ch, ch) for ch in str(s))
    # pdflatex without inputenc tricks wants ASCII: anything else becomes "?".
    return out.encode("ascii", "replace").decode("ascii")


def to_latex(t: Table) -> str:
    n = len(t.columns)
    caption = t.title + "."
    if t.label:
        caption = f"\\textbf{{{tex_escape(t.label)}}} " + tex_escape(caption)
    else:
        caption = tex_escape(caption)
    out = ["% Generated by `python -m paper_tables` from run results; do not edit by hand.",
           "% Needs \\usepackage{booktabs}.",
           "\\begin{table}[htbp]", "\\centering", f"\\caption{{{caption}}}",
           f"\\label{{tab:{t.stem}}}", "\\begin{tabular}{l" + " crr" * n + "}", "\\toprule"]
    out.append(" & ".join([""] + [f"\\multicolumn{{3}}{{c}}{{{tex_escape(c.label)}}}" for c in t.columns])
               + " \\\\")
    out.append(" ".join(f"\\cmidrule(lr){{{2 + 3 * i}-{4 + 3 * i}}}" for i in range(n)))
    out.append(" & ".join(["Model"] + ["ours & paper & $\\Delta$"] * n) + " \\\\")
    out.append("\\midrule")
    for model, label in t.rows:
        row = [tex_escape(label)]
        for c in t.columns:
            cell = t.cells[(model, c.id)]
            row += [tex_escape(cell.ours_text()), tex_escape(cell.paper_text()), tex_escape(cell.diff_text())]
        out.append(" & ".join(row) + " \\\\")
    out += ["\\bottomrule", "\\end{tabular}", "\\par\\smallskip", "{\\footnotesize\\raggedright",
            tex_escape(t.intro().replace("`", "")) + "\\par"]
    out.append("Environment: " + (tex_escape("; ".join(t.env)) if t.env else "no runs yet") + ".\\par")
    if t.problems:
        out.append("Skipped: " + tex_escape("; ".join(str(p) for p in t.problems)) + ".\\par")
    out += ["}", "\\end{table}", ""]
    return "\n".join(out)


# ----------------------------------------------------------------------------- CSV
CSV_FIELDS = ("ours_mean", "ours_std", "n", "status", "ours_text", "paper", "diff", "diff_text")


def to_csv(t: Table) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["profile", "model", "label"] + [f"{c.id}|{f}" for c in t.columns for f in CSV_FIELDS])
    for rec in t.records():
        row = [rec["profile"], rec["model"], rec["label"]]
        for c in t.columns:
            cell = rec["cells"][c.id]
            # repr keeps every digit, so reading the CSV back gives the same floats.
            row += ["" if cell[f] is None else (repr(cell[f]) if isinstance(cell[f], float) else cell[f])
                    for f in CSV_FIELDS]
        w.writerow(row)
    return buf.getvalue()


def read_csv(text: str) -> list[dict]:
    """Parse what to_csv wrote back into Table.records()' shape."""
    reader = csv.reader(io.StringIO(text))
    header = next(reader)
    out = []
    for row in reader:
        rec = {"profile": row[0], "model": row[1], "label": row[2], "cells": {}}
        for name, value in zip(header[3:], row[3:]):
            col, field = name.rsplit("|", 1)
            if value == "":
                v = None
            elif field == "n":
                v = int(value)
            elif field in ("ours_mean", "ours_std", "diff"):
                v = float(value)
            elif field == "paper":
                try:
                    v = float(value)
                except ValueError:
                    v = value
            else:
                v = value
            rec["cells"].setdefault(col, {})[field] = v
        out.append(rec)
    return out


# ----------------------------------------------------------------------------- HTML fragment
def to_html(t: Table) -> str:
    e = html.escape
    out = [f'<section class="table" id="{e(t.stem)}">', f"<h3>{e(t.title)}</h3>"]
    if t.label:
        out.append(f'<p class="profile-label">{e(t.label)}</p>')
    out.append(f"<p>{e(t.intro().replace('`', ''))}</p>")
    out.append('<table class="results"><thead><tr><th rowspan="2">Model</th>')
    out += [f'<th colspan="3">{e(c.label)}</th>' for c in t.columns]
    out.append("</tr><tr>" + "<th>ours</th><th>paper</th><th>Δ</th>" * len(t.columns) + "</tr></thead><tbody>")
    for model, label in t.rows:
        out.append(f"<tr><th>{e(label)}</th>")
        for c in t.columns:
            cell = t.cells[(model, c.id)]
            out.append(f'<td class="ours {cell.status}" title="{e(", ".join(cell.runs))}">'
                       f"{e(cell.ours_text())}</td><td class=\"paper\">{e(cell.paper_text())}</td>"
                       f'<td class="diff">{e(cell.diff_text())}</td>')
        out.append("</tr>")
    out.append("</tbody></table>")
    notes = t.spec.paper.get("notes", [])
    out.append("<p>Paper notes:</p><ul>" + "".join(f"<li>{e(n)}</li>" for n in notes) + "</ul>")
    out.append(f"<p>Environment of the {t.n_runs} run(s) behind this table:</p><ul>"
               + ("".join(f"<li>{e(x)}</li>" for x in t.env) or "<li>no runs yet</li>") + "</ul>")
    out.append('<p>Skipped or questionable results:</p><ul class="problems">'
               + ("".join(f"<li><code>{e(p.where)}</code>: {e(p.what)}</li>" for p in t.problems)
                  or "<li>none</li>") + "</ul></section>")
    return "\n".join(out)
