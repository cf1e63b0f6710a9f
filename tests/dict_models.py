"""A Hugging Face-shaped model and data set: dict samples in, {"loss", "logits"} out."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

VOCAB, LENGTH, CLASSES = 20, 6, 3


class TinyClassifier(nn.Module):
    """``forward(input_ids, attention_mask, labels=None)`` -> ``{"loss" (with labels), "logits"}``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, input_ids, attention_mask, labels=None):
        mask = attention_mask.unsqueeze(-1).float()
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1)
        logits = self.head(pooled)
        output = {"logits": logits}
        if labels is not None:
            output["loss"] = nn.functional.cross_entropy(logits, labels)
        return output


class TokenData(Dataset):
    """Each sample: ``{"input_ids", "attention_mask", <label_key>}``; the class follows the first token."""

    def __init__(self, n: int = 48, seed: int = 0, label_key: str = "labels") -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, LENGTH), generator=generator)
        self.mask = (torch.rand(n, LENGTH, generator=generator) > 0.2).long()
        self.mask[:, 0] = 1
        self.labels = self.ids[:, 0] % CLASSES
        self.label_key = label_key

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.ids[index],
            "attention_mask": self.mask[index],
            self.label_key: self.labels[index],
        }


def hand_loop(data: TokenData, batch: int, epochs: int, lr: float) -> TinyClassifier:
    """The reference: the model's own loss, SGD, the data in order."""
    torch.manual_seed(0)
    network = TinyClassifier()
    optimizer = torch.optim.SGD(network.parameters(), lr=lr)
    for _ in range(epochs):
        for start in range(0, len(data), batch):
            index = slice(start, start + batch)
            loss = network(data.ids[index], data.mask[index], labels=data.labels[index])["loss"]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return network
