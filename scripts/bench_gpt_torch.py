"""tdist-train's byte-level GPT (apps/train/models.cpp) in PyTorch, for the anchors of
`tdist-bench fsdp` (bench_fsdp_torch.py) and `tdist-bench pipeline --model gpt`
(bench_pipeline_torch.py): token embedding 256 x width and a learned position embedding (both
N(0, 0.02)), `layers` pre-norm blocks [LayerNorm, causal self-attention (one Linear
width->3 width, one width->width), residual; LayerNorm, Linear width->4 width, GELU, Linear
4 width->width, residual], a final LayerNorm and a Linear width->256 without bias.
"""
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, w, h):
        super().__init__()
        self.heads = h
        self.ln1 = nn.LayerNorm(w)
        self.qkv = nn.Linear(w, 3 * w)
        self.proj = nn.Linear(w, w)
        self.ln2 = nn.LayerNorm(w)
        self.fc = nn.Linear(w, 4 * w)
        self.out = nn.Linear(4 * w, w)

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, w // self.heads) \
            .permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, w))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class _Embed(nn.Module):  # the first of layers(): the GPT's own embedding tensors
    def __init__(self, gpt):
        super().__init__()
        self.tokens, self.positions = gpt.tokens, gpt.positions

    def forward(self, idx):
        return self.tokens(idx) + self.positions[: idx.size(1)]


class _Head(nn.Module):  # the last of layers(): the final LayerNorm and the head
    def __init__(self, gpt):
        super().__init__()
        self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x):
        return self.head(self.ln_f(x))


class GPT(nn.Module):
    def __init__(self, width, heads, layers, context):
        super().__init__()
        self.tokens = nn.Embedding(256, width)
        self.positions = nn.Parameter(torch.empty(context, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256, bias=False)
        with torch.no_grad():
            self.tokens.weight.normal_(0.0, 0.02)
            self.positions.normal_(0.0, 0.02)

    def forward(self, idx):
        x = self.tokens(idx) + self.positions[: idx.size(1)]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))

    def layers(self):
        """The model as tdist-train's layers() gives it to a pipeline: [embedding, block 0, ...,
        block L-1, head], sharing this model's parameters."""
        return nn.Sequential(_Embed(self), *self.blocks, _Head(self))
