"""Committed results files and the README tables generated from them (paper_tables/committed.py): every
committed block is what its file gives, an export keeps what a table needs, a block is rewritten from its
file, and a stale one is found."""
from __future__ import annotations

import json

import pytest
from test_paper_tables import write_run

from mpt.errors import UserError
from paper_tables import __main__ as cli_main
from paper_tables import committed

TOP1 = {"fp32": [70.0, 72.0, 74.0], "mixed": [71.0, 73.0, 75.0]}


def test_committed_readme_blocks_are_current():
    """Every paper_tables block of the repository's Markdown equals what its results file gives: edit the
    file (python -m paper_tables export), then run `python -m paper_tables readme`."""
    files = committed.doc_files()
    assert files, "no README holds a paper_tables block"
    assert committed.stale(files) == [], "run `python -m paper_tables readme`"


@pytest.fixture
def exported(tmp_path):
    for precision, values in TOP1.items():
        for seed, v in enumerate(values):
            write_run(tmp_path / "runs", "ilsvrc_cnns", "resnet50_preact", precision, seed, profile="tiny",
                      metrics={"top1": v, "top5": 99.0})
    write_run(tmp_path / "runs", "ilsvrc_cnns", "alexnet", "fp32", 0, profile="tiny", status="diverged")
    out = tmp_path / "exp" / "results" / "demo.jsonl"
    assert cli_main.main(["export", "--runs", str(tmp_path / "runs"), "--out", str(out), "--machine", "Test CPU"]) == 0
    return out


def test_export_writes_one_line_per_run_with_what_a_table_needs(exported):
    lines = [json.loads(x) for x in exported.read_text().splitlines()]
    assert len(lines) == 7
    mixed0 = next(d for d in lines if d["precision"] == "mixed" and d["seed"] == 0)
    assert mixed0["metrics"]["top1"] == 71.0 and mixed0["status"] == "completed"
    assert mixed0["machine"] == "Test CPU" and mixed0["code"]["git_commit"] == "0123456789abcdef"
    assert mixed0["loss_scale"] == "dynamic" and mixed0["profile"] == "tiny" and mixed0["wall_time_s"] == 1.0
    assert {d["status"] for d in lines} == {"completed", "diverged"}


def test_readme_block_is_rewritten_from_its_file_and_a_stale_one_is_found(exported):
    readme = exported.parent.parent / "README.md"
    readme.write_text("# x\n\ntyped text stays\n\n<!-- paper_tables: results/demo.jsonl -->\nold numbers\n"
                      "<!-- /paper_tables -->\n\nafter\n")
    assert committed.stale([readme]) == [readme]
    assert cli_main.main(["readme", "--check", str(readme)]) == 1
    assert cli_main.main(["readme", str(readme)]) == 0
    text = readme.read_text()
    assert "old numbers" not in text and text.startswith("# x\n\ntyped text stays\n") and text.endswith("\n\nafter\n")
    assert committed.stale([readme]) == [] and cli_main.main(["readme", "--check", str(readme)]) == 0
    row = {line.split(" | ")[1]: line for line in text.splitlines() if line.startswith("| resnet50_preact")}
    # mean ± sample std over seeds 0-2, each seed's value, and Δ against FP32 (+1.00, well inside 2 SE)
    assert "72.00 ± 2.00 (n=3)" in row["fp32"] and "0: 70.00, 1: 72.00, 2: 74.00" in row["fp32"]
    assert "73.00 ± 2.00 (n=3)" in row["mixed S=dynamic"] and "+1.00 vs FP32 (within seed noise)" in row["mixed S=dynamic"]
    assert "| alexnet | fp32 | diverged | 0: diverged |" in text
    assert "Test CPU" in text and "0123456789abcdef" not in text  # the commit stays in the file


def test_another_metric_and_a_changed_file(exported):
    readme = exported.parent.parent / "README.md"
    readme.write_text("<!-- paper_tables: results/demo.jsonl metric=top5 -->\n<!-- /paper_tables -->\n")
    committed.rewrite([readme])
    assert "top5 (higher is better)" in readme.read_text() and "99.00 ± 0.00 (n=3)" in readme.read_text()
    lines = exported.read_text().splitlines()
    exported.write_text("\n".join(lines[:-1]) + "\n")  # a run fewer: the block no longer matches
    assert committed.stale([readme]) == [readme]


def test_runs_started_by_hand_are_counted_beside_the_grid_command(exported):
    """A results file whose runs came partly from slurm.submit and partly from the experiment's own command
    names the submit command and says how many runs it does not cover."""
    lines = committed.load(exported)
    for d in lines:  # (as slurm.submit's submissions.jsonl gives them)
        d["command"] = "python -m slurm.submit experiments/ilsvrc_cnns/grid.yaml --profile tiny"
    text = committed.to_markdown(lines, "demo.jsonl")
    assert "outside slurm.submit" not in text and "Made by `python -m slurm.submit" in text
    lines[0]["command"] = lines[1]["command"] = None
    text = committed.to_markdown(lines, "demo.jsonl")
    assert "; 2 of the runs outside slurm.submit, their command not recorded." in text
    assert "Made by `python -m slurm.submit" in text


def test_bad_input_is_one_line(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("<!-- paper_tables: results/none.jsonl -->\n<!-- /paper_tables -->\n")
    with pytest.raises(UserError, match="no such results file"):
        committed.rewrite([readme])
    with pytest.raises(SystemExit) as e:
        cli_main.main(["export", "--runs", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x.jsonl")])
    assert e.value.code == 2 and "--runs" in capsys.readouterr().err


def test_a_switched_recipe_is_a_row_against_its_preset_with_its_sqnr(tmp_path):
    """Runs of grid_switches.yaml: a preset with fmt.* keys flipped is a row of its own, labelled by those keys,
    with Δ against FP32 and against the preset and the gradients' SQNR -- in the committed table and under
    paper_tables' beyond-the-paper table."""
    import yaml
    from test_paper_tables import build

    ppl = {"fp32": ([80.0, 82.0, 84.0], None), "nvfp4": ([90.0, 91.0, 92.0], 15.0),
           "nvfp4 fmt.w.granularity=nvfp4_16": ([100.0, 101.0, 102.0], 12.0)}
    for col, (values, db) in ppl.items():
        precision, *keys = col.split()
        for seed, v in enumerate(values):
            d = write_run(tmp_path / "runs", "lm_biglstm", "biglstm", precision, seed, profile="tiny",
                          metrics={"ppl": v}, name=f"{precision}-{len(keys)}-s{seed}",
                          numerics=[{"numerics/sqnr/grad_median": db + seed + k} for k in (-1, 0, 1)] if db else ())
            cfg = yaml.safe_load((d / "config.yaml").read_text())
            cfg["fmt"] = {"w": {"granularity": "nvfp4_16"}} if keys else {}
            (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "results" / "switches.jsonl"
    assert cli_main.main(["export", "--runs", str(tmp_path / "runs"), "--out", str(out)]) == 0
    lines = committed.load(out)
    assert {d["precision"]: d["sqnr_db"] for d in lines} == {
        "fp32": None, "nvfp4": 17.0, "nvfp4 fmt.w.granularity=nvfp4_16": 14.0}  # seed 2's: seed + the median step
    text = committed.to_markdown(lines, "switches.jsonl")
    assert "| Δ vs preset | grad SQNR dB (seeds' range) |" in text
    row = next(x for x in text.splitlines() if "| nvfp4 fmt.w.granularity=nvfp4_16 " in x)
    assert "+19.00 vs FP32 (DIFFERS: > 2 SE)" in row and "+10.00 vs nvfp4 (DIFFERS: > 2 SE)" in row
    assert row.count("fmt.w.granularity") == 1 and "| 13.0 (12.0-14.0) |" in row
    preset = next(x for x in text.splitlines() if x.startswith("| biglstm | nvfp4 |"))
    assert "vs nvfp4" not in preset and "| 16.0 (15.0-17.0) |" in preset
    # paper_tables' own output: the beyond table's nvfp4 cell holds the preset alone, the switches their table
    _, _, rep = build(tmp_path / "runs")
    b = next(s.beyond for s in rep.sections if s.profile == "tiny")
    assert b.cells[("final_lm", "biglstm", "nvfp4")].values == [90.0, 91.0, 92.0]
    assert [(m, len(ls)) for _, m, ls in b.switches] == [("biglstm", 9)]
    from paper_tables import beyond

    assert "+10.00 vs nvfp4 (DIFFERS: > 2 SE)" in beyond.to_markdown(b)


def test_export_takes_a_cells_overrides_from_its_job_file_where_no_submission_names_it(tmp_path):
    """A local launcher writes its submission record as it ends; one killed before (a machine taken back) left
    cells no record names. Their job.json (slurm.job) holds the cell's overrides: the export reads the cell's
    keys from there, so a switched recipe is not merged into its preset's row; a submission record still wins."""
    runs = tmp_path / "runs"
    switched = write_run(runs, "ilsvrc_cnns", "resnet8_cifar", "nvfp4", 1, profile="real", metrics={"top1": 66.0},
                         name="resnet8_cifar-nvfp4-s1-aaa")
    named = write_run(runs, "ilsvrc_cnns", "resnet8_cifar", "nvfp4", 2, profile="real", metrics={"top1": 67.0},
                      name="resnet8_cifar-nvfp4-s2-bbb")
    plain = write_run(runs, "ilsvrc_cnns", "resnet8_cifar", "nvfp4", 0, profile="real", metrics={"top1": 65.0},
                      name="resnet8_cifar-nvfp4-s0-ccc")
    cell = ["profile=real", "wandb.mode=disabled", "precision=nvfp4", "fmt.g.rounding=nearest", "model=resnet8_cifar",
            f"out_dir={runs}"]
    (switched / "job.json").write_text(json.dumps({"cell_id": "x", "attempts": [], "overrides": [*cell, "seed=1"]}))
    (named / "job.json").write_text(json.dumps({"cell_id": "y", "attempts": [], "overrides": [*cell, "seed=2"]}))
    (plain / "job.json").write_text(json.dumps({"cell_id": "z", "attempts": []}))  # (written before the overrides were)
    (runs / "ilsvrc_cnns" / "submissions.jsonl").write_text(json.dumps(
        {"argv": ["grid.yaml"], "grid": "grid.yaml",
         "cells": [{"run_name": named.name, "overrides": ["precision=nvfp4", "fmt.w.granularity=nvfp4_16"]}]}) + "\n")
    out = tmp_path / "switches.jsonl"
    assert cli_main.main(["export", "--runs", str(runs), "--out", str(out)]) == 0
    got = {d["run_name"]: (d["config"], d["command"]) for d in map(json.loads, out.read_text().splitlines())}
    assert got[switched.name] == (["fmt.g.rounding=nearest"], None)
    assert got[named.name] == (["fmt.w.granularity=nvfp4_16"], "python -m slurm.submit grid.yaml")
    assert got[plain.name] == ([], None)
