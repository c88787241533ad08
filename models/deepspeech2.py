"""DeepSpeech 2 (Amodei et al. 2016) as the mixed-precision paper trained it (section 4.3): two 2D
convolutions over the spectrogram, three GRU layers, one row-convolution (lookahead) layer, a fully
connected output layer and CTC; about 115M parameters (English) and 215M (Mandarin).

Unidirectional GRUs: a row convolution exists to give a *forward-only* RNN a little future context
(Amodei et al. 2016, section 3.5 "Lookahead Convolution and Unidirectional Models"); a bidirectional
RNN already sees the whole utterance and would not need one. The paper's "3 GRU layers + 1 row
convolution" is therefore DS2's deployable unidirectional model.

Layer sizes (Amodei et al. 2016, Table 2/section 3.5, and the public deepspeech.pytorch
reproduction): 32 filters of 41x11 (frequency x time), stride 2x2, then 32 of 21x11, stride 2x1,
each with batch norm and the clipped ReLU min(max(x, 0), 20); 20 future frames of row convolution.
Sequence-wise batch norm (section 3.2) normalises the vertical input of GRU layers 2-3 and of the
output layer over every *valid* frame of the batch (padding frames never enter the statistics). The
paper gives only the parameter counts, not the GRU width: the widths below are the ones that match
them (tests/test_deepspeech2.py checks the counts within 5%).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from models import register

N_FREQ = 161  # 20 ms windows of 16 kHz audio (n_fft 320): Amodei et al. 2016, section 3
ENGLISH_VOCAB = 29  # CTC blank, space, apostrophe, a-z
# AISHELL-1's transcripts use about 4.2K distinct characters (ESPnet's AISHELL token list: 4,231 +
# blank/unk); the prepared data's own vocabulary is used at run time, this only sizes the default.
MANDARIN_VOCAB = 4233
HIDDEN = {"english": 2624, "mandarin": 3520}  # GRU width that gives ~115M / ~215M parameters
CONV_CHANNELS = 32
LOOKAHEAD = 20


def out_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """Frames after the convolutions: only the first one strides in time (2), kernel 11, padding 5."""
    return torch.div(lengths + 2 * 5 - 11, 2, rounding_mode="floor") + 1


def masked_batch_norm(x: torch.Tensor, mask: torch.Tensor, bn: nn.modules.batchnorm._BatchNorm, dim: int) -> torch.Tensor:
    """`bn` (a BatchNorm layer over channel dimension `dim` of x) with its statistics over the positions
    where `mask` (broadcastable to x without the channel dimension kept as size 1) is True only.

    Masked sums instead of selecting the positions (x[mask]): a boolean index has a data-dependent
    size, a host read (GPU sync) per layer per step, forward and backward. The same formula as
    F.batch_norm on the selected positions: biased variance to normalise, the unbiased one into the
    running average; reductions in FP32 on FP16 inputs (paper section 3.3), output in x's dtype.
    Positions outside the mask get bias only (callers zero them). In eval mode, the running
    statistics (no reduction, no mask needed)."""
    dims = [d for d in range(x.dim()) if d != dim]
    shape = [1] * x.dim()
    shape[dim] = x.shape[dim]
    if not (bn.training or bn.running_mean is None):
        return F.batch_norm(x.movedim(dim, 1), bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0,
                            bn.eps).movedim(1, dim).to(x.dtype)
    xf = x.float()
    m = mask.to(xf.dtype)
    n = (m.expand([s if d != dim else 1 for d, s in enumerate(x.shape)]).sum()).clamp(min=1)
    mean = (xf * m).sum(dims) / n
    xc = (xf - mean.view(shape)) * m
    var = (xc * xc).sum(dims) / n
    scale = torch.rsqrt(var + bn.eps)
    if bn.weight is not None:
        scale = scale * bn.weight.float()
    y = xc * scale.view(shape)
    if bn.bias is not None:
        y = y + bn.bias.float().view(shape)
    if bn.training and bn.running_mean is not None:
        with torch.no_grad():
            bn.num_batches_tracked.add_(1)
            mom = bn.momentum if bn.momentum is not None else 1.0 / bn.num_batches_tracked
            bn.running_mean.mul_(1 - mom).add_(mom * mean.to(bn.running_mean.dtype))
            unbiased = var * n / (n - 1).clamp(min=1)
            bn.running_var.mul_(1 - mom).add_(mom * unbiased.to(bn.running_var.dtype))
    return y.to(x.dtype)


class SequenceBatchNorm(nn.Module):
    """Batch norm over every valid (n, t) frame of a padded (N, T, C) batch; padding stays zero."""

    def __init__(self, channels: int):
        super().__init__()
        self.bn = nn.BatchNorm1d(channels)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return masked_batch_norm(x, mask[..., None], self.bn, dim=2) * mask[..., None].to(x.dtype)


class RowConv(nn.Module):
    """Lookahead convolution (Amodei et al. 2016, section 3.5): each feature is a learned weighted
    sum of itself over the current and the next `context` frames (a depthwise convolution in time)."""

    def __init__(self, channels: int, context: int):
        super().__init__()
        self.context = context
        self.conv = nn.Conv1d(channels, channels, context + 1, groups=channels, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, T, C)
        return self.conv(F.pad(x.transpose(1, 2), (0, self.context))).transpose(1, 2)


class DeepSpeech2(nn.Module):
    def __init__(self, vocab: int, hidden: int, conv_channels: int = CONV_CHANNELS, gru_layers: int = 3,
                 lookahead: int = LOOKAHEAD, n_freq: int = N_FREQ, blank_prior: float = 0.0):
        super().__init__()
        if not 0.0 <= blank_prior < 1.0:
            raise ValueError(f"blank_prior={blank_prior}: the blank's share of output frames, in [0, 1)")
        c = conv_channels
        self.conv = nn.ModuleList([
            nn.Sequential(nn.Conv2d(1, c, (41, 11), stride=(2, 2), padding=(20, 5), bias=False), nn.BatchNorm2d(c),
                          nn.Hardtanh(0, 20, inplace=True)),
            nn.Sequential(nn.Conv2d(c, c, (21, 11), stride=(2, 1), padding=(10, 5), bias=False), nn.BatchNorm2d(c),
                          nn.Hardtanh(0, 20, inplace=True))])
        f = (n_freq + 2 * 20 - 41) // 2 + 1
        f = (f + 2 * 10 - 21) // 2 + 1
        self.grus = nn.ModuleList(nn.GRU(c * f if i == 0 else hidden, hidden, batch_first=True)
                                  for i in range(gru_layers))
        # The first GRU reads the convolutions' batch-normed output; the others get their own.
        self.norms = nn.ModuleList(SequenceBatchNorm(hidden) for _ in range(gru_layers - 1))
        self.lookahead = RowConv(hidden, lookahead)
        self.out_norm = SequenceBatchNorm(hidden)
        self.fc = nn.Linear(hidden, vocab)
        if blank_prior > 0:
            # Output 0 (CTC's blank) starts at `blank_prior`, the others share the rest evenly: its bias is the
            # log-odds of blank against one character. From DS2's uniform start CTC first drives every frame
            # towards blank, and a short run can stay in that all-blank state (Zeyer et al. 2021, "Why does
            # CTC result in peaky behavior?": from a uniform start gradient descent converges towards it).
            with torch.no_grad():
                self.fc.bias[0] = math.log(blank_prior * (vocab - 1) / (1.0 - blank_prior))

    def forward(self, spec: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """spec (N, F, T) log spectrogram, lengths (N,) valid frames -> (logits (N, T', V), lengths')."""
        lengths = out_lengths(lengths)
        x = spec.unsqueeze(1)
        for conv, bn, act in self.conv:
            # Frames past each utterance's end are zeroed after every block, so that a padded
            # utterance's valid frames see what they would see alone (the time kernels reach 5 frames
            # into the padding). Batch-norm statistics include the padding up to the batch's longest
            # utterance, as in DS2 reproductions (which pad to it), but not the frames beyond it that
            # the task's collate adds to round the length up (task.pad_to_multiple): the result does
            # not depend on that rounding.
            x = conv(x)
            t = x.shape[-1]
            frames = torch.arange(t, device=x.device)
            x = act(masked_batch_norm(x, frames < lengths.max(), bn, dim=1))
            mask = frames[None, :] < lengths.clamp(max=t)[:, None]
            x = x * mask[:, None, None, :].to(x.dtype)
        n, c, f, t = x.shape
        x = x.reshape(n, c * f, t).transpose(1, 2)  # (N, T', C*F')
        lengths = lengths.clamp(max=t)
        # Forward-only GRUs: frames past an utterance's end never reach its valid frames, so the
        # padded batch needs no packing; the padding is zeroed before the row convolution looks ahead.
        for i, gru in enumerate(self.grus):
            if i > 0:
                x = self.norms[i - 1](x, mask)
            x = gru(x)[0]
        x = x * mask.unsqueeze(-1).to(x.dtype)
        x = F.hardtanh(self.lookahead(x), 0, 20)
        return self.fc(self.out_norm(x, mask)), lengths


def _build(name: str, vocab: int | None, width: float, n_freq: int, conv_channels: int,
           blank_prior: float) -> DeepSpeech2:
    """conv_channels 0: CONV_CHANNELS scaled by `width` like the GRUs (at least 4); blank_prior 0: uniform outputs."""
    v = vocab or (ENGLISH_VOCAB if name == "english" else MANDARIN_VOCAB)
    return DeepSpeech2(v, hidden=max(8, round(HIDDEN[name] * width)),
                       conv_channels=conv_channels or max(4, round(CONV_CHANNELS * width)), n_freq=n_freq,
                       blank_prior=blank_prior)


@register("english", batch_norm=True)
def english(vocab: int | None = None, width: float = 1.0, n_freq: int = N_FREQ, conv_channels: int = 0,
            blank_prior: float = 0.0) -> DeepSpeech2:
    return _build("english", vocab, width, n_freq, conv_channels, blank_prior)


@register("mandarin", batch_norm=True)
def mandarin(vocab: int | None = None, width: float = 1.0, n_freq: int = N_FREQ, conv_channels: int = 0,
            blank_prior: float = 0.0) -> DeepSpeech2:
    return _build("mandarin", vocab, width, n_freq, conv_channels, blank_prior)
