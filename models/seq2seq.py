"""The attention LSTM translation model of the paper's Figure 4 (section 4.4).

The paper trains "TensorFlow's sequence-to-sequence tutorial" model on WMT15 English-French: 3 (and 5)
layers of 1024 LSTM cells in the encoder and in the decoder, with attention. That tutorial
(tensorflow/models tutorials/rnn/translate: translate.py, seq2seq_model.py, the 2017 TensorFlow
"Sequence-to-Sequence Models" page) builds embedding_attention_seq2seq:

    source ids, reversed and left-padded -> embedding (V_en x 1024) -> L x LSTM-1024 (the encoder)
    <GO> + target ids -> embedding (V_fr x 1024) -> L x LSTM-1024, started from the encoder's final
    state (the decoder) -> attention over the encoder outputs -> projection to V_fr -> softmax

We keep its shape, sizes, reversed source and state hand-over. The attention is Luong et al. 2015's
global "general" attention as the later TensorFlow NMT tutorial (tensorflow/nmt, attention=luong,
output_attention=true) computes it: score(h_t, s) = h_t^T W_a s, context c_t = sum softmax(score) s,
attentional state tanh(W_c [c_t; h_t]) -> output projection. Deviation: no input feeding (feeding
the previous attentional state into the next decoder input) -- without it the decoder runs as one
cuDNN call over the whole target sentence in training, which is what makes the paper-size model
affordable; the mixed-precision question (do FP16 gradients of this network train like FP32's?) is
the same.

`nmt_lstm3` / `nmt_lstm5` build the 3- and 5-layer variants; `width` scales the cells and embeddings
(1024 w). Full size with the tutorial's 40,000-word vocabularies: see `param_count` (176,446,528 for
3 layers; nn.LSTM keeps two bias vectors per layer). Initialisation uniform in +-0.1 (tensorflow/nmt's
default init_weight). The softmax runs in FP32 (section 3.3): the task casts the logits.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from models import register

FULL = {"src_vocab": 40_000, "tgt_vocab": 40_000, "hidden": 1024}  # translate.py's vocabularies, size 1024


def _autocast_input(x: torch.Tensor) -> torch.Tensor:
    """Embeddings are not autocast (they stay FP32); torch's CPU LSTM under FP16 autocast fails in
    oneDNN on FP32 inputs, so hand it the autocast dtype (on CUDA autocast casts it the same way)."""
    dev = x.device.type
    return x.to(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else x


class AttentionSeq2Seq(nn.Module):
    def __init__(self, src_vocab: int, tgt_vocab: int, hidden: int, num_layers: int, dropout: float = 0.0,
                 pad_id: int = 0, init: float = 0.1):
        super().__init__()
        self.hidden, self.num_layers, self.pad_id = hidden, num_layers, pad_id
        self.src_emb = nn.Embedding(src_vocab, hidden, padding_idx=pad_id)
        self.tgt_emb = nn.Embedding(tgt_vocab, hidden, padding_idx=pad_id)
        self.encoder = nn.LSTM(hidden, hidden, num_layers, batch_first=True, dropout=dropout)
        self.decoder = nn.LSTM(hidden, hidden, num_layers, batch_first=True, dropout=dropout)
        self.attn = nn.Linear(hidden, hidden, bias=False)  # W_a of the "general" score
        self.combine = nn.Linear(2 * hidden, hidden, bias=False)  # W_c: attentional state
        self.out = nn.Linear(hidden, tgt_vocab)
        self.drop = nn.Dropout(dropout)
        for p in self.parameters():
            nn.init.uniform_(p, -init, init)
        with torch.no_grad():
            self.src_emb.weight[pad_id].zero_()
            self.tgt_emb.weight[pad_id].zero_()

    def encode(self, src: torch.Tensor):
        """src [B, S]: reversed source ids, padding first (translate.py's layout), so the final state
        the decoder starts from is the one after the first source word."""
        mem, state = self.encoder(_autocast_input(self.drop(self.src_emb(src))))
        return mem, state

    def decode(self, tgt_in: torch.Tensor, mem: torch.Tensor, src_mask: torch.Tensor, state):
        """Logits [B, T, V] (the model's dtype) for decoder inputs tgt_in [B, T]."""
        h, state = self.decoder(_autocast_input(self.drop(self.tgt_emb(tgt_in))), state)
        scores = torch.bmm(self.attn(h), mem.transpose(1, 2)).float()  # [B, T, S]; softmax in FP32 (3.3)
        scores = scores.masked_fill(~src_mask[:, None, :], float("-inf"))
        ctx = torch.bmm(F.softmax(scores, dim=-1).to(mem.dtype), mem)
        att = torch.tanh(self.combine(torch.cat([ctx, h], dim=-1)))
        return self.out(self.drop(att)), state

    def forward(self, src, src_mask, tgt_in):
        mem, state = self.encode(src)
        return self.decode(tgt_in, mem, src_mask, state)[0]

    @torch.no_grad()
    def greedy(self, src, src_mask, bos: int, eos: int, max_len: int) -> torch.Tensor:
        """Greedy decoding: [B, <= max_len] ids, each row ending at its first eos (then pad)."""
        mem, state = self.encode(src)
        B = src.shape[0]
        prev = torch.full((B, 1), bos, dtype=torch.long, device=src.device)
        done = torch.zeros(B, dtype=torch.bool, device=src.device)
        out = []
        for _ in range(max_len):
            logits, state = self.decode(prev, mem, src_mask, state)
            nxt = logits[:, -1].float().argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, self.pad_id), nxt)
            out.append(nxt)
            done |= nxt == eos
            if bool(done.all()):
                break
            prev = nxt[:, None]
        return torch.stack(out, 1) if out else torch.zeros(B, 0, dtype=torch.long, device=src.device)


def param_count(src_vocab: int, tgt_vocab: int, hidden: int, num_layers: int) -> int:
    """Parameters of AttentionSeq2Seq in closed form."""
    lstm = num_layers * (4 * hidden * (hidden + hidden) + 2 * 4 * hidden)
    return ((src_vocab + tgt_vocab) * hidden + 2 * lstm + hidden * hidden + 2 * hidden * hidden
            + hidden * tgt_vocab + tgt_vocab)


def _build(num_layers: int, src_vocab: int = FULL["src_vocab"], tgt_vocab: int = FULL["tgt_vocab"],
           width: float = 1.0, dropout: float = 0.0, pad_id: int = 0, init: float = 0.1) -> AttentionSeq2Seq:
    hidden = max(4, round(FULL["hidden"] * width))
    return AttentionSeq2Seq(src_vocab, tgt_vocab, hidden, num_layers, dropout=dropout, pad_id=pad_id, init=init)


@register("nmt_lstm3")
def nmt_lstm3(**kw) -> AttentionSeq2Seq:
    """The paper's WMT15 model: 3 x LSTM-1024 encoder and decoder with attention."""
    return _build(3, **kw)


@register("nmt_lstm5")
def nmt_lstm5(**kw) -> AttentionSeq2Seq:
    """The paper's 5-layer variant."""
    return _build(5, **kw)


if __name__ == "__main__":
    for n in (3, 5):
        print(f"nmt_lstm{n}: {param_count(FULL['src_vocab'], FULL['tgt_vocab'], FULL['hidden'], n):,} parameters "
              f"(vocabularies {FULL['src_vocab']:,} / {FULL['tgt_vocab']:,}, 1024 cells)")
