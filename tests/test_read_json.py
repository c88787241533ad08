"""Tolerant JSON reads (mpt.rundir.read_json, slurm.job.read_job_file): a half-written file gives the
default only when one is asked for."""
import pytest


def test_read_json_default_only_when_asked(tmp_path):
    from mpt.rundir import read_json
    from slurm.job import read_job_file

    (tmp_path / "half.json").write_text('{"a": ')
    assert read_json(tmp_path / "half.json", default=None) is None and read_job_file(tmp_path) is None
    with pytest.raises(ValueError):
        read_json(tmp_path / "half.json")
    (tmp_path / "job.json").write_text('{"attempts": []}')
    assert read_job_file(tmp_path) == {"attempts": []}
