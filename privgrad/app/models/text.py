"""The IMDB model of Ghosh & Das (Table 2) with an LSTM made of linear cells.

torch's fused ``nn.LSTM`` has no per-sample gradient rule. :class:`DPLSTM` computes the
same recurrence from two ``nn.Linear`` layers (input and hidden projections, as Opacus'
DPLSTM does), so the engine's linear rule gives exact per-sample gradients: the input
projection runs once over the whole sequence, the hidden projection once per time step.
"""

from __future__ import annotations

import torch
from torch import nn


class LSTMDirection(nn.Module):
    """One direction of an LSTM layer: gates i, f, g, o as in ``nn.LSTM``."""

    def __init__(self, input_size: int, hidden_size: int, reverse: bool = False):
        super().__init__()
        self.hidden_size, self.reverse = hidden_size, reverse
        self.ih = nn.Linear(input_size, 4 * hidden_size)
        self.hh = nn.Linear(hidden_size, 4 * hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, in) -> (B, T, hidden)
        B, T, _ = x.shape
        # one view per time step from a single unbind: indexing gates_x[:, t] instead costs a
        # zero-filled (B, T, 4·hidden) gradient per step in the backward pass (T² memory traffic)
        gates_x = self.ih(x).unbind(1)
        h = x.new_zeros(B, self.hidden_size)
        c = x.new_zeros(B, self.hidden_size)
        out = [None] * T
        for t in range(T - 1, -1, -1) if self.reverse else range(T):
            i, f, g, o = (gates_x[t] + self.hh(h)).chunk(4, dim=1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            out[t] = h
        return torch.stack(out, 1)


class DPLSTM(nn.Module):
    """A single-layer, batch-first (bi)LSTM with per-sample-gradient-friendly parameters."""

    def __init__(self, input_size: int, hidden_size: int, bidirectional: bool = False):
        super().__init__()
        self.directions = nn.ModuleList([LSTMDirection(input_size, hidden_size)])
        if bidirectional:
            self.directions.append(LSTMDirection(input_size, hidden_size, reverse=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([d(x) for d in self.directions], dim=-1)


class BiLSTMClassifier(nn.Module):
    """Embedding 100 → FC 32 → BiLSTM 32 per direction, mean over time → FC 16 → FC 2."""

    def __init__(
        self,
        num_tokens: int,
        num_classes: int = 2,
        embed: int = 100,
        hidden: int = 32,
        act: nn.Module | None = None,
    ):
        super().__init__()
        self.embedding = nn.Embedding(num_tokens, embed, padding_idx=0)
        self.proj = nn.Linear(embed, 32)
        self.act = act or nn.ReLU()
        self.lstm = DPLSTM(32, hidden, bidirectional=True)
        self.fc = nn.Linear(2 * hidden, 16)
        self.out = nn.Linear(16, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.act(self.proj(self.embedding(tokens)))
        h = self.lstm(h).mean(1)
        return self.out(self.act(self.fc(h)))
