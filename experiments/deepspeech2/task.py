"""Task glue for Table 3 and Figure 2: DeepSpeech 2 with CTC on LibriSpeech (English) and AISHELL-1
(Mandarin), the public stand-ins for the paper's internal data (section 4.3).

Features: log spectrograms of 20 ms windows with a 10 ms hop, normalised per utterance (Amodei et
al. 2016, section 3). Batches are padded with their lengths (collate); the first epoch runs
shortest-first (SortaGrad, Amodei et al. 2016 section 3.1; train_order). CTC runs on FP32
log-probabilities (section 3.3: reductions in FP32) with zero_infinity off, so an impossible
alignment or an overflow shows as a non-finite loss instead of being hidden. Evaluation: greedy CTC
decoding, character error rate (the paper's metric, percent) and word error rate, as additive
edit-distance sums (exact under DDP).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from data_prep.speech import decode, read_manifest
from models.deepspeech2 import out_lengths
from mpt.config import added, infra
from mpt.errors import UserError
from mpt.task import Task as BaseTask

BLANK = 0
ENGLISH = " 'abcdefghijklmnopqrstuvwxyz"  # LibriSpeech's alphabet, lower-cased; index 0 is the CTC blank
SAMPLE_RATE = 16_000


@dataclass
class TaskCfg:
    data_root: str = infra("data/librispeech")  # output of python -m data_prep.librispeech / data_prep.aishell
    train_sets: list[str] = field(default_factory=lambda: ["train-clean-100", "train-clean-360", "train-other-500"])
    val_set: str = "dev-clean"  # the manifest CER is measured on (test-clean / test for final numbers)
    max_duration: float = 0.0  # seconds; longer training utterances are left out (0 = keep all)
    sortagrad: bool = True  # epoch 0 shortest-first (Amodei et al. 2016, section 3.1)
    # Spectrogram windows: 20 ms with a 10 ms hop (Amodei et al. 2016, section 3): 161 frequency bins.
    window_ms: float = 20.0
    hop_ms: float = 10.0
    cache_features: bool = infra(False)  # keep spectrograms in memory (small datasets, num_workers=0)
    # Batches are padded in time to a multiple of this many frames (1 = to the longest utterance).
    # With cudnn.benchmark on, every new input shape re-runs cuDNN's convolution search; lengths
    # rounded to 64 frames (0.64 s) give a few dozen shapes instead of one per batch. The masks and
    # lengths make the result independent of it (models/deepspeech2.py; tests/test_deepspeech2.py).
    pad_to_multiple: int = 64
    # Channels of each convolution; 0: the paper's 32 scaled by `width` like the GRUs (at least 4).
    conv_channels: int = added(0)
    # After epoch 0: shuffle whole batches of duration neighbours instead of utterances (train_order).
    bucket_batches: bool = added(False)
    # Start the output layer at the blank's share of the training set's output frames (blank_share), not at
    # DS2's uniform outputs: README "The blank's prior".
    blank_prior_init: bool = added(False)


def vocabulary(model: str, root: Path) -> str:
    """The output characters after the blank: English's fixed alphabet, or the Mandarin training
    transcripts' characters (data_prep.aishell writes them to vocab.txt)."""
    if model == "english":
        return ENGLISH
    path = root / "vocab.txt"
    if not path.is_file():
        raise UserError(f"no {path}; prepare AISHELL-1 first (python -m data_prep.aishell --archives DIR --out {root})")
    return "".join(line for line in path.read_text(encoding="utf-8").splitlines() if line)


def manifest_rows(root: Path, names: list[str], max_duration: float = 0.0) -> list[dict]:
    """The utterances of the manifests `names` (at most `max_duration` s; 0: all), sorted by duration."""
    rows = [r for n in names for r in read_manifest(root / "manifests" / f"{n}.jsonl")]
    if max_duration > 0:
        rows = [r for r in rows if r["duration"] <= max_duration]
    if not rows:
        raise UserError(f"no utterances in {root}/manifests/{{{','.join(names)}}}.jsonl"
                        + (f" of at most {max_duration} s" if max_duration > 0 else ""))
    return sorted(rows, key=lambda r: (r["duration"], r["id"]))


def blank_share(rows: list[dict], chars: str, lower: bool, hop: int) -> float:
    """The share of the model's output frames that are blank in a CTC alignment of these utterances: 1 -
    their target characters / their output frames (a spectrogram frame every `hop` samples, centred, then
    the convolutions' stride). English at the tiny profile's 20 ms hop: ~0.58; Mandarin at 10 ms: ~0.93."""
    index = set(chars)
    n_chars = sum(sum(c in index for c in (r["text"].lower() if lower else r["text"])) for r in rows)
    frames = torch.tensor([round(r["duration"] * SAMPLE_RATE) // hop + 1 for r in rows])
    n_frames = int(out_lengths(frames).sum())
    if n_chars >= n_frames:
        raise UserError(f"task.blank_prior_init: the training transcripts hold {n_chars} characters for {n_frames} "
                        f"output frames (CTC needs at least one frame each); set task.blank_prior_init=false")
    return 1.0 - n_chars / n_frames


class SpeechSet(torch.utils.data.Dataset):
    """Utterances of one or more manifests (each sorted by duration; the union is re-sorted):
    (log spectrogram (F, T), target ids, transcript)."""

    def __init__(self, root: Path, names: list[str], chars: str, lower: bool, n_fft: int, hop: int,
                 max_duration: float = 0.0, cache: bool = False):
        import torchaudio

        self.rows = manifest_rows(root, names, max_duration)
        self.root, self.lower = root, lower
        self.index = {c: i + 1 for i, c in enumerate(chars)}
        self.spec = torchaudio.transforms.Spectrogram(n_fft=n_fft, hop_length=hop, power=2.0)
        self.cache = {} if cache else None

    def __len__(self):
        return len(self.rows)

    def text(self, i: int) -> str:
        t = self.rows[i]["text"]
        return t.lower() if self.lower else t

    def features(self, i: int) -> torch.Tensor:
        if self.cache is not None and i in self.cache:
            return self.cache[i]
        x, _ = decode(self.root / self.rows[i]["audio"], str(self.root / self.rows[i]["audio"]))
        s = torch.log1p(self.spec(torch.from_numpy(x)))
        s = (s - s.mean()) / (s.std() + 1e-5)  # per-utterance normalisation
        if self.cache is not None:
            self.cache[i] = s
        return s

    def __getitem__(self, i: int):
        text = self.text(i)
        # Characters the model cannot output (a Mandarin character absent from the training
        # transcripts) are left out of the CTC target; CER still counts them against the output.
        target = torch.tensor([self.index[c] for c in text if c in self.index], dtype=torch.long)
        return self.features(i), target, text


def _window(c) -> tuple[int, int]:
    """(n_fft, hop) in samples from task.window_ms and task.hop_ms."""
    n_fft, hop = round(SAMPLE_RATE * c.window_ms / 1000), round(SAMPLE_RATE * c.hop_ms / 1000)
    if not (0 < hop <= n_fft):
        raise UserError(f"task.hop_ms={c.hop_ms} must be > 0 and at most task.window_ms={c.window_ms}")
    return n_fft, hop


class Task(BaseTask):
    primary_metric = "cer"  # percent, the paper's Table 3 metric
    higher_is_better = False
    data_files = ("vocab.txt",)  # Mandarin's characters (data_prep.aishell): part of the run identity

    @classmethod
    def expected_data(cls, cfg):
        """English reads LibriSpeech, Mandarin AISHELL-1 (prepared.json's "dataset", data_prep module)."""
        return ("librispeech", "librispeech") if cfg.model == "english" else ("aishell", "aishell")

    @classmethod
    def check(cls, cfg):
        _window(cfg.task)
        if cfg.task.conv_channels < 0:
            raise UserError(f"task.conv_channels={cfg.task.conv_channels} must be >= 0 (0: scaled by width)")
        if cfg.task.pad_to_multiple < 1:
            raise UserError(f"task.pad_to_multiple={cfg.task.pad_to_multiple} must be >= 1 (1: pad to the "
                            f"longest utterance)")

    @dataclass(frozen=True)
    class Facts:
        chars: str  # the output characters after the blank (English's alphabet; AISHELL-1's vocab.txt)

    @classmethod
    def read_facts(cls, cfg):
        root = Path(cfg.task.data_root)
        if not (root / "prepared.json").is_file():
            prep = "librispeech" if cfg.model == "english" else "aishell"
            raise UserError(f"{root} is not a prepared dataset (no prepared.json); run "
                            f"python -m data_prep.{prep} --archives DIR --out {root}")
        return cls.Facts(chars=vocabulary(cfg.model, root))

    def datasets(self):
        cfg = self.cfg
        c = cfg.task
        root = Path(c.data_root)
        lower = cfg.model == "english"
        n_fft, hop = _window(c)
        chars = self.facts.chars
        train = SpeechSet(root, list(c.train_sets), chars, lower, n_fft, hop, c.max_duration, c.cache_features)
        val = SpeechSet(root, [c.val_set], chars, lower, n_fft, hop, cache=c.cache_features)
        return train, val

    def build_model(self):
        import models

        c = self.cfg.task
        n_fft, hop = _window(c)
        chars = self.facts.chars
        prior = blank_share(manifest_rows(Path(c.data_root), list(c.train_sets), c.max_duration), chars,
                            self.cfg.model == "english", hop) if c.blank_prior_init else 0.0
        return models.build(self.cfg.model, vocab=len(chars) + 1, width=self.cfg.width, n_freq=n_fft // 2 + 1,
                            conv_channels=c.conv_channels, blank_prior=prior)

    def collate(self, samples):
        feats, targets, texts = zip(*samples)
        lengths = torch.tensor([f.shape[1] for f in feats])
        k = self.cfg.task.pad_to_multiple
        x = feats[0].new_zeros(len(feats), feats[0].shape[0], -(-int(lengths.max()) // k) * k)
        for i, f in enumerate(feats):
            x[i, :, : f.shape[1]] = f
        target_lengths = torch.tensor([len(t) for t in targets])
        # CTC needs the lengths on the host (torch's CUDA ctc_loss copies them there): computed here,
        # from the host copies, they cost no device read. A list, which the engine leaves on the host.
        return {"x": x, "lengths": lengths, "targets": torch.cat(targets), "target_lengths": target_lengths,
                "host_lengths": [out_lengths(lengths).tolist(), target_lengths.tolist()], "texts": list(texts)}

    def train_order(self, train, epoch: int, generator: torch.Generator):
        if epoch == 0 and self.cfg.task.sortagrad:
            return range(len(train))  # the dataset is sorted by duration: shortest first
        if not self.cfg.task.bucket_batches:
            return torch.randperm(len(train), generator=generator).tolist()
        # Batches of neighbours in the duration-sorted set, in a random order (deepspeech.pytorch's
        # DSRandomSampler): each batch is padded to a length close to its shortest utterance's, where a
        # batch drawn from the whole set pads to ~1.5 x the mean duration.
        b = self.cfg.train.batch_size
        n = len(train) - len(train) % b
        bins = torch.randperm(n // b, generator=generator).tolist()
        return [i for k in bins for i in range(k * b, (k + 1) * b)] + list(range(n, len(train)))

    def ctc(self, model, batch):
        logits, lengths = model(batch["x"], batch["lengths"])
        # Host lengths (collate) when the batch has them: the same numbers as the model's (out_lengths
        # of the input lengths; the padding never shortens them), without a device read.
        host = batch.get("host_lengths")
        in_len, tgt_len = (torch.tensor(host[0]), torch.tensor(host[1])) if host is not None \
            else (lengths, batch["target_lengths"])
        # FP32 log-softmax and CTC (section 3.3): outside autocast, on an FP32 copy of the logits.
        with torch.autocast(logits.device.type, enabled=False):
            log_probs = logits.float().log_softmax(-1)
            # Sum over each utterance, mean over the batch (the DS2 reproductions' normalisation).
            loss = F.ctc_loss(log_probs.transpose(0, 1), batch["targets"], in_len, tgt_len,
                              blank=BLANK, reduction="sum", zero_infinity=False) / logits.shape[0]
        return loss, log_probs, lengths

    def loss(self, model, batch):
        loss, _, _ = self.ctc(model, batch)
        return loss, batch["x"].shape[0]

    def greedy(self, log_probs: torch.Tensor, lengths: torch.Tensor) -> list[str]:
        """Best path: the most likely symbol per frame, repeats merged, blanks dropped."""
        out = []
        for best, n in zip(log_probs.argmax(-1).tolist(), lengths.tolist()):
            prev, s = BLANK, []
            for k in best[:n]:
                if k != prev and k != BLANK:
                    s.append(self.facts.chars[k - 1])
                prev = k
            out.append("".join(s))
        return out

    def eval_sums(self, model, batch):
        from torchaudio.functional import edit_distance

        loss, log_probs, lengths = self.ctc(model, batch)
        n = len(batch["texts"])
        sums = {"loss_sum": float(loss) * n, "n": n, "char_err": 0, "chars": 0, "word_err": 0, "words": 0}
        for hyp, ref in zip(self.greedy(log_probs, lengths), batch["texts"]):
            sums["char_err"] += edit_distance(ref, hyp)
            sums["chars"] += len(ref)
            sums["word_err"] += edit_distance(ref.split(), hyp.split())
            sums["words"] += len(ref.split())
        return sums

    def eval_metrics(self, s):
        # Mandarin transcripts have no spaces: its WER is the sentence error rate (one "word" each).
        return {"cer": round(100 * s["char_err"] / max(s["chars"], 1), 3),
                "wer": round(100 * s["word_err"] / max(s["words"], 1), 3),
                "loss": round(s["loss_sum"] / max(s["n"], 1), 4)}  # CTC per utterance: Figure 2a's eval curve
