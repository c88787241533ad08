"""DCGAN (Figure 6): CelebA prep of the tiny release and its bad-input errors, tiny runs in every
paper precision writing sample grids and the SWD, and real learning (trained beats untrained)."""
import json
import shutil
import zipfile

import pytest
import torch

from bad_input import assert_command_fails_in_one_line
from conftest import tiny_overrides
from data_prep.celeba import prepare as prep
from data_prep.celeba.tiny import generate
from mpt.errors import UserError



# The small networks here run far faster on one thread (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def celeba_archives(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("celeba_archives"), train=320, valid=48, test=16)


@pytest.fixture(scope="module")
def tiny_celeba(celeba_archives, tmp_path_factory):
    out = tmp_path_factory.mktemp("celeba_prepared")
    prep.prepare(celeba_archives, out, log=lambda *a: None)
    return out




def test_prep_layout_counts_and_resume(celeba_archives, tiny_celeba, tmp_path):
    info = json.loads((tiny_celeba / "prepared.json").read_text())
    assert (info["images"], info["train"], info["valid"], info["test"], info["attributes"]) == (384, 320, 48, 16, 8)
    root = tiny_celeba / "celeba"
    assert len(list((root / "img_align_celeba").glob("*.jpg"))) == 384
    assert (root / "list_eval_partition.txt").is_file() and (root / "list_attr_celeba.txt").is_file()
    # resumable: an interrupted run (no marker, an image missing) keeps what it had
    out = tmp_path / "p"
    shutil.copytree(tiny_celeba, out)
    (out / "prepared.json").unlink()
    (out / "celeba" / "img_align_celeba" / "000007.jpg").unlink()
    again = prep.prepare(celeba_archives, out, log=lambda *a: None)
    assert again["skipped"] == 383 and (out / "celeba" / "img_align_celeba" / "000007.jpg").is_file()


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("damage,msg", [
    ("missing", "no img_align_celeba.zip"),
    ("truncated", "is truncated or not a zip"),
    ("corrupt", "is corrupt at img_align_celeba/"),
    ("partition", "disagrees with"),
    # the zip's CRC was computed over the damage, the first bytes still say JPEG
    ("garbage_jpeg", "img_align_celeba/000003.jpg does not decode as a JPEG"),
    ("small_jpeg", "img_align_celeba/000003.jpg is a 64x64 JPEG image; CelebA's aligned images are 178x218"),
])
def test_prep_bad_inputs_are_one_line_errors(celeba_archives, tmp_path, damage, msg):
    a = _copy(celeba_archives, tmp_path / "a")
    z = a / prep.ZIP
    if damage == "missing":
        z.unlink()
    elif damage == "truncated":
        z.write_bytes(z.read_bytes()[: z.stat().st_size // 2])
    elif damage == "corrupt":  # flip bytes inside one stored image: its CRC no longer matches
        with zipfile.ZipFile(z) as zf:
            info = zf.getinfo("img_align_celeba/000003.jpg")
        data = bytearray(z.read_bytes())
        start = info.header_offset + 30 + len(info.filename) + 500
        data[start:start + 64] = bytes(64)
        z.write_bytes(bytes(data))
    elif damage in ("garbage_jpeg", "small_jpeg"):
        import io

        from PIL import Image

        with zipfile.ZipFile(z) as zf:
            members = [(i.filename, zf.read(i)) for i in zf.infolist()]
        with zipfile.ZipFile(z, "w") as zf:
            for name, data in members:
                if name.endswith("000003.jpg"):
                    buf = io.BytesIO()
                    Image.new("RGB", (64, 64)).save(buf, "JPEG")
                    data = data[:2] + bytes(len(data) - 2) if damage == "garbage_jpeg" else buf.getvalue()
                zf.writestr(name, data)
    else:
        lines = (a / prep.PARTITION).read_text().splitlines()
        (a / prep.PARTITION).write_text("\n".join(lines[:-1] + ["999999.jpg 2"]) + "\n")
    with pytest.raises(UserError, match=msg):
        prep.prepare(a, tmp_path / "out", log=lambda *x: None)
    if damage == "truncated":  # and from the command line: one line, exit code 2
        assert_command_fails_in_one_line("data_prep.celeba", a, tmp_path / "out2", msg)


@pytest.mark.heavy
@pytest.mark.parametrize("prec,impl", [("fp32", "autocast"), ("fp16", "autocast"), ("mixed", "autocast"),
                                       ("mixed", "paper")])
def test_tiny_run_writes_samples_and_metric(tiny_celeba, tmp_path, prec, impl):
    from experiments.dcgan import main
    from experiments.dcgan.swd import multiscale_swd
    from experiments.dcgan.task import SWD_SEED, Task
    from mpt import config as C

    # FP16 on a CPU is slow: 16-px images, 4-channel networks, two steps.
    args = tiny_overrides(tiny_celeba, tmp_path, f"precision={prec}", f"impl={impl}", "task.image_size=16",
                          "width=0.0625", "train.batch_size=8", "train.max_steps=2", "task.grid=4",
                          "task.eval_samples=8", "train.log_every=1")
    s = main(args)
    assert s["status"] == "completed" and s["skipped_per_optimizer"].keys() == {"discriminator", "generator"}
    # The SWD measures a distance to real faces: the 2-step generator's samples are farther from the
    # 8 held-out faces than 8 other real faces (training images) are.
    train, val = Task(C.resolve("dcgan", args)).datasets()
    real_to_real = multiscale_swd(torch.stack([train[i] for i in range(8)]), torch.stack([val[i] for i in range(8)]),
                                  seed=SWD_SEED)
    assert s["metrics"]["swd"] > real_to_real["swd"] and "swd_16" in s["metrics"], (s["metrics"], real_to_real)
    d = tmp_path / "dcgan" / s["run_name"]
    from PIL import Image

    with Image.open(d / "samples_0000002.png") as im:
        assert im.size == (2 * 16 + 3 * 2, 2 * 16 + 3 * 2)  # 2 x 2 grid of 16 px with 2 px padding
    train = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
    assert {"loss_D", "loss_G", "D_real", "D_fake"} <= set(train[-1])


@pytest.mark.heavy
@pytest.mark.parametrize("size,steps", [
    (16, 120),  # the default suite: 16-px faces, about 30 s on 2 idle cores
    pytest.param(32, 250, marks=pytest.mark.slow),  # the tiny profile's 32 px, minutes
])
def test_trained_generator_beats_untrained(tiny_celeba, tmp_path, size, steps):
    """Real learning, not a smoke test: the tiny profile's networks after a few hundred steps against
    the same networks through the engine at lr 0 (one step that changes no weight), evaluated on the
    same held-out faces and latents."""
    from experiments.dcgan import main

    args = tiny_overrides(tiny_celeba, tmp_path, f"train.max_steps={steps}", "task.eval_samples=48",
                          f"task.image_size={size}")
    s = main(args)
    untrained = main(tiny_overrides(tiny_celeba, tmp_path / "untrained", "train.max_steps=1", "optim.lr=0",
                                    "task.eval_samples=48", f"task.image_size={size}"))["metrics"]["swd"]
    assert s["status"] == "completed"
    assert s["metrics"]["swd"] < 0.75 * untrained, (s["metrics"], untrained)
