"""The bigLSTM language model of the paper's Figure 5 (section 4.5), as in Jozefowicz et al. 2016.

"Exploring the Limits of Language Modeling" (Jozefowicz et al., arXiv 1602.02410) and its public
TensorFlow code (github.com/rafaljozefowicz/lm; NVIDIA's fork github.com/okuchaiev/f-lm, whose README
gives the BIGLSTM command line) define the model the mixed-precision paper trains:

    word ids -> embedding (V x 1024) -> dropout
             -> LSTM, 8192 cells, projected to 1024 (LSTMP) -> dropout
             -> LSTM, 8192 cells, projected to 1024 -> dropout
             -> softmax over the V = 793,471-word vocabulary: sampled (8192 negatives) in training,
                full in evaluation.

`biglstm(vocab_size, width)` builds it; `width` scales the cell count (8192 w), the projection and the
embedding (1024 w): width=1/32 with a tiny vocabulary is the CPU variant of the tests. Full size:
1,776,948,095 parameters -- two 793,471 x 1024 tables (embedding, softmax weights: 812,514,304 each),
the softmax bias (793,471) and two LSTMP layers of 75,563,008 (nn.LSTM keeps two bias vectors per layer;
the TensorFlow cell has one, 32,768 fewer per layer).

Details that follow the reference code (model_utils.py / language_model.py of rafaljozefowicz/lm):
- Forget-gate bias 1: TensorFlow adds a constant 1.0 inside sigmoid(f + 1); we initialise the forget
  slice of the input bias to 1, which trains identically.
- Initialisation: embedding and softmax weights uniform in +-sqrt(3 / V) (TF's uniform unit scaling
  over the full [V, d] shape); LSTM kernels Glorot-uniform over TF's concatenated [input + proj, 4H]
  kernel (one limit for weight_ih and weight_hh), the projection Glorot-uniform over [H, P]; the LSTM
  bias 0 (forget 1); the softmax bias uniform in +-sqrt(3 / V) (TF's default Glorot on a vector).
- Dropout (keep_prob 0.9) on the embeddings and on the output of every LSTM layer.
- Sampled softmax = tf.nn.sampled_softmax_loss with its defaults: num_sampled candidates per batch,
  drawn without replacement from the log-uniform (Zipfian) distribution over ids sorted by frequency,
  every logit corrected by -log(expected count), accidental hits of the true class removed.

Precision: the softmax layer runs in FP32 whatever the precision, as in the reference code the paper's
bigLSTM ran (okuchaiev/f-lm language_model.py: softmax_w and softmax_b are FP32 variables whatever its
float16_rnn / float16_non_rnn switches, and the LSTM output is cast with tf.to_float before both the sampled
and the full softmax). Its parameters stay FP32 under impl=paper (`keep_fp32`, mpt.precision) and its
matmuls run outside autocast on FP32 inputs; the rest of the model follows the recipe. `softmax_fp16=True`
is the other choice: the table stored in the model's dtype and the sampled-logit matmul in FP16, the
logits still cast to FP32 before the log-sum-exp (section 3.3).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from models import register
from mpt.errors import UserError

# The paper's bigLSTM (section 4.5) = Jozefowicz et al.'s BIG LSTM: 2 x LSTM-8192-1024, 1024-d embeddings.
FULL = {"vocab_size": 793_471, "emb_size": 1024, "hidden_size": 8192, "proj_size": 1024, "num_layers": 2,
        "num_sampled": 8192}
# Elements of one chunk of full-softmax logits in evaluation (256 MiB in FP32): bounds the memory of
# a 793K-word softmax over thousands of tokens.
_EVAL_CHUNK = 1 << 26


# ------------------------------------------------------------------------------------------------
# log-uniform candidate sampling (TensorFlow's LogUniformCandidateSampler, unique=True)


def log_uniform_prob(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """P(k) = log((k + 2) / (k + 1)) / log(V + 1): Zipf's law over ids sorted by frequency (FP64)."""
    k = ids.to(torch.float64)
    return torch.log1p(1.0 / (k + 1.0)) / math.log(vocab_size + 1.0)


def sample_log_uniform(num_sampled: int, vocab_size: int, device, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`num_sampled` distinct ids drawn from the log-uniform distribution, in the order they first
    appear, and the number of draws it took (num_tries, a 0-d int64 tensor: the expected count of each
    id is 1 - (1 - p)^num_tries).

    TensorFlow's sampler (unique=True) draws ids one by one until num_sampled distinct ones have
    appeared. We produce the same joint distribution of (ordered ids, num_tries) with a fixed amount of
    work on the device and no host read (a data-dependent loop would stop the GPU queue every step):
    - Skipping repeats, the first appearances are successive sampling without replacement with
      probabilities p: the next new id is k with probability p_k / (1 - mass already seen). That is the
      order of an exponential race, E_k / p_k with E_k ~ Exp(1) (Efraimidis & Spirakis 2006): the
      num_sampled smallest keys, in increasing order.
    - Given the first j distinct ids (mass S_j), the repeats before the next new id are geometric,
      P(G_j >= g) = S_j^g, independently of which id comes next; num_tries = num_sampled + sum_j G_j,
      G_j = floor(log U / log S_j) with U uniform in (0, 1].
    One pass costs V uniforms and a top-k over V (793K at full size); the draw-by-draw loop it replaces
    needed about 2 x num_sampled draws, a unique() and a host read of its size."""
    if not 0 < num_sampled < vocab_size:
        raise UserError(f"num_sampled={num_sampled} must be between 1 and the vocabulary size - 1 ({vocab_size - 1}); "
                        f"use num_sampled=0 for the full softmax")
    p = log_uniform_prob(torch.arange(vocab_size, device=device), vocab_size)
    u = torch.rand(vocab_size, dtype=torch.float64, device=device, generator=generator)
    keys = -torch.log1p(-u) / p  # Exp(1) / p_k; u < 1, so finite
    ids = keys.topk(num_sampled, largest=False, sorted=True).indices
    seen = torch.cumsum(p[ids], 0)[:-1]  # S_1 .. S_{num_sampled - 1}
    # Below 1 by construction (ids leave at least one id unseen); clamped against rounding only.
    seen = seen.clamp(max=1.0 - 2.0 ** -52)
    u = torch.rand(num_sampled - 1, dtype=torch.float64, device=device, generator=generator)
    repeats = torch.floor(torch.log1p(-u) / torch.log(seen))
    return ids, (num_sampled + repeats.sum()).to(torch.int64)


def expected_count(ids: torch.Tensor, num_tries: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Probability that id appears among num_tries draws (TF's unique-sampling expected count), FP64."""
    p = log_uniform_prob(ids, vocab_size)
    return -torch.expm1(num_tries.to(torch.float64) * torch.log1p(-p))


# ------------------------------------------------------------------------------------------------
# softmax layer


class Softmax(nn.Module):
    """Output layer: weight [V, P] (rows are word vectors, as TensorFlow stores softmax_w) and bias [V].

    forward(h [N, P], targets [N]) -> per-token negative log-likelihood [N] in FP32: the sampled-softmax
    loss in training (num_sampled > 0), the exact full-softmax NLL otherwise (evaluation).

    keep_fp32 (default, the reference's choice): FP32 parameters under impl=paper, and the whole layer
    computed in FP32 on an FP32 copy of h, outside autocast."""

    def __init__(self, vocab_size: int, dim: int, num_sampled: int, fp32: bool = True):
        super().__init__()
        self.vocab_size, self.num_sampled = vocab_size, num_sampled
        self.keep_fp32 = fp32  # read by mpt.precision.convert_model
        self.weight = nn.Parameter(torch.empty(vocab_size, dim))
        self.bias = nn.Parameter(torch.empty(vocab_size))

    def forward(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.keep_fp32:
            with torch.autocast(h.device.type, enabled=False):
                return self._nll(h.float(), targets)
        return self._nll(h, targets)

    def _nll(self, h, targets):
        if self.training and self.num_sampled > 0:
            return self.sampled_nll(h, targets)
        return self.full_nll(h, targets)

    def sampled_nll(self, h, targets):
        V = self.vocab_size
        ids, tries = sample_log_uniform(self.num_sampled, V, h.device)
        # One gather for true and sampled rows: one dense [V, P] gradient, not two.
        rows = torch.cat([targets, ids])
        w = F.embedding(rows, self.weight)
        b = self.bias[rows].float()
        log_q = torch.log(expected_count(rows, tries, V)).float()
        n = targets.numel()
        w_true, w_samp = w[:n], w[n:]
        # True logits: one dot product per token, in FP32 (N x P multiply-adds, cheap).
        true_logit = (h.float() * w_true.float()).sum(-1) + b[:n] - log_q[:n]
        # Sampled logits: the big matmul in h's dtype (FP32 unless softmax_fp16), the softmax in FP32 (3.3).
        samp_logit = (h @ w_samp.t()).float() + b[n:] - log_q[n:]
        # Accidental hits: a sampled id equal to the token's target is not a negative for that token.
        hit = ids[None, :] == targets[:, None]
        samp_logit.masked_fill_(hit, torch.finfo(torch.float32).min)  # in place: a fresh FP32 tensor
        logits = torch.cat([true_logit[:, None], samp_logit], dim=1)
        return torch.logsumexp(logits, dim=1) - true_logit

    def full_nll(self, h, targets):
        rows_per_chunk = max(1, _EVAL_CHUNK // self.vocab_size)
        w = self.weight
        out = []
        for i in range(0, h.shape[0], rows_per_chunk):
            logits = (h[i:i + rows_per_chunk] @ w.t()).float() + self.bias.float()
            t = targets[i:i + rows_per_chunk]
            out.append(torch.logsumexp(logits, dim=1) - logits.gather(1, t[:, None])[:, 0])
        return torch.cat(out) if out else h.new_zeros(0, dtype=torch.float32)


# ------------------------------------------------------------------------------------------------
# the model


class BigLSTM(nn.Module):
    """forward(x, y, mask, state) -> (nll [B, T] FP32, zero where mask is False; new state).

    x, y: [B, T] int64 input and target ids; mask: [B, T] bool, the targets that count; state: list of
    (h [B, P], c [B, H]) per layer, or None for zeros. The returned state is not detached (the caller
    truncates back-propagation)."""

    def __init__(self, vocab_size: int, emb_size: int, hidden_size: int, proj_size: int, num_layers: int = 2,
                 num_sampled: int = 8192, dropout: float = 0.1, forget_bias: float = 1.0, softmax_fp16: bool = False):
        super().__init__()
        if min(vocab_size, emb_size, hidden_size, proj_size, num_layers) < 1:
            raise UserError("biglstm needs vocab_size, emb_size, hidden_size, proj_size and num_layers >= 1")
        if not 0 <= dropout < 1:
            raise UserError(f"dropout={dropout} must be in [0, 1)")
        self.vocab_size, self.hidden_size, self.proj_size = vocab_size, hidden_size, proj_size
        self.embedding = nn.Embedding(vocab_size, emb_size)
        self.drop_in = nn.Dropout(dropout)
        self.lstm = nn.ModuleList(
            nn.LSTM(emb_size if i == 0 else proj_size, hidden_size, proj_size=proj_size, batch_first=True)
            for i in range(num_layers))
        self.drop_out = nn.ModuleList(nn.Dropout(dropout) for _ in range(num_layers))
        self.softmax = Softmax(vocab_size, proj_size, num_sampled, fp32=not softmax_fp16)
        self.reset_parameters(forget_bias)

    @torch.no_grad()
    def reset_parameters(self, forget_bias: float = 1.0) -> None:
        table = math.sqrt(3.0 / self.vocab_size)
        nn.init.uniform_(self.embedding.weight, -table, table)
        nn.init.uniform_(self.softmax.weight, -table, table)
        nn.init.uniform_(self.softmax.bias, -table, table)
        H, P = self.hidden_size, self.proj_size
        for layer in self.lstm:
            kernel = math.sqrt(6.0 / (layer.input_size + P + 4 * H))
            nn.init.uniform_(layer.weight_ih_l0, -kernel, kernel)
            nn.init.uniform_(layer.weight_hh_l0, -kernel, kernel)
            proj = math.sqrt(6.0 / (H + P))
            nn.init.uniform_(layer.weight_hr_l0, -proj, proj)
            layer.bias_ih_l0.zero_()
            layer.bias_hh_l0.zero_()
            layer.bias_ih_l0[H:2 * H] = forget_bias  # PyTorch gate order: input, forget, cell, output

    def zero_state(self, batch: int, device=None, dtype=torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.zeros(batch, self.proj_size, device=device, dtype=dtype),
                 torch.zeros(batch, self.hidden_size, device=device, dtype=dtype)) for _ in self.lstm]

    def forward(self, x, y, mask, state=None):
        B, T = x.shape
        if state is None:
            state = self.zero_state(B, x.device, self.embedding.weight.dtype)
        h = self.drop_in(self.embedding(x))
        new_state = []
        for layer, drop, (h0, c0) in zip(self.lstm, self.drop_out, state):
            h, (hn, cn) = layer(h, (h0[None], c0[None]))
            h = drop(h)
            new_state.append((hn[0], cn[0]))
        # The softmax runs for every position and the targets that do not count (</S> -> <S>
        # transitions, padding) are zeroed after it: selecting the counted rows first (h[mask]) has a
        # data-dependent size, which on a GPU is a host read that stalls the queue every step. In
        # training it costs the sampled softmax about 1 row in 27 more (1B Word's sentence breaks); the
        # sampled ids are shared by the batch, so every counted row's loss is what it was.
        nll = self.softmax(h.reshape(B * T, -1), y.reshape(-1)).view(B, T)
        return torch.where(mask, nll, 0.0), new_state


@register("biglstm")
def biglstm(vocab_size: int = FULL["vocab_size"], width: float = 1.0, num_sampled: int = FULL["num_sampled"],
            num_layers: int = FULL["num_layers"], dropout: float = 0.1, forget_bias: float = 1.0,
            softmax_fp16: bool = False) -> BigLSTM:
    """The paper's bigLSTM (width=1): 2 x LSTM-8192 projected to 1024, 1024-d embeddings."""
    def scaled(n):
        return max(1, round(n * width))

    return BigLSTM(vocab_size, scaled(FULL["emb_size"]), scaled(FULL["hidden_size"]), scaled(FULL["proj_size"]),
                   num_layers, num_sampled, dropout, forget_bias, softmax_fp16)


def parameter_count(vocab_size: int, emb: int, hidden: int, proj: int, layers: int) -> int:
    """Parameters of BigLSTM, in closed form (nn.LSTM: two bias vectors per layer)."""
    lstm = sum(4 * hidden * ((emb if i == 0 else proj) + proj) + 2 * 4 * hidden + proj * hidden for i in range(layers))
    return vocab_size * emb + lstm + vocab_size * proj + vocab_size
