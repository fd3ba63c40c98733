"""Real-document sequence packing for the torch trainer.

Documents are text files (default: the Python standard library's own source
files, which ship with every Python install; ``--data-dir`` points at a user's
files).  Tokens are raw bytes (vocabulary 256).  Documents are packed greedily,
in a seeded shuffled order, into micro-batches of exactly ``token_budget`` (N)
tokens; a document that does not fit the space left is split and its remainder
opens the next micro-batch.  Each micro-batch carries its document segment
lengths so the model can run causal attention per document: attention cost
then follows sum(l^2) over the segments, not N^2.

Micro-batch ``g`` (a global index: iteration * global_batch + j) is a pure
function of (files, seed, N, g), so the data order does not depend on how many
replicas or stages run it: a reconfigured job sees the same data.
"""

from __future__ import annotations

import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: Target value for positions that have no next token inside their document.
IGNORE_INDEX = -100


def default_data_dir() -> Path:
    """The standard library source directory of the running Python."""
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass(frozen=True)
class PackedMicroBatch:
    """N tokens made of whole or split documents, with next-token targets."""

    index: int
    tokens: np.ndarray  # int64 [N], byte values
    targets: np.ndarray  # int64 [N], IGNORE_INDEX at each segment's last position
    doc_lens: tuple[int, ...]  # segment lengths, sum == N

    @property
    def token_budget(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_docs(self) -> int:
        return len(self.doc_lens)

    @property
    def sum_sq_len(self) -> float:
        return float(sum(x * x for x in self.doc_lens))

    @property
    def max_len(self) -> int:
        return max(self.doc_lens)

    @property
    def num_targets(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())


class PackedCorpus:
    """Deterministic packed micro-batches over a directory of text files."""

    def __init__(
        self,
        data_dir: str | Path | None = None,
        token_budget: int = 1024,
        seed: int = 0,
        pattern: str = "*.py",
        max_doc_tokens: int | None = None,
        min_doc_tokens: int = 2,
        token_budgets: tuple[int, ...] = (),
        repeat_index: int = -1,
        cache_window: int = 4096,
    ):
        """``token_budgets``: draw each micro-batch's N from these (seeded per
        index) instead of ``token_budget``; ``repeat_index`` >= 0: every index
        returns that one micro-batch (timing noise floor)."""
        if token_budgets:
            token_budget = max(token_budgets)
        if token_budget < 2 or any(b < 2 for b in token_budgets):
            raise ValueError(f"token_budget must be >= 2, got {token_budget}")
        root = Path(data_dir) if data_dir else default_data_dir()
        if not root.is_dir():
            raise ValueError(f"data_dir {str(root)!r} is not a directory")
        files = sorted(p for p in root.rglob(pattern) if p.is_file())
        if not files:
            raise ValueError(f"no files matching {pattern!r} under {str(root)!r}")
        random.Random(seed).shuffle(files)
        self.root = root
        self.files = files
        self.token_budget = token_budget
        self.token_budgets = tuple(token_budgets)
        self.repeat_index = repeat_index
        self.seed = seed
        self.max_doc_tokens = max_doc_tokens or token_budget
        self.min_doc_tokens = min_doc_tokens
        # Packed micro-batches by index; only the last ``cache_window`` are kept
        # (training reads forward, and re-reads one iteration after a failure).
        self.cache_window = cache_window
        self._reset_packer()

    def _reset_packer(self) -> None:
        self._packed: dict[int, PackedMicroBatch] = {}
        self._next = 0  # index of the next micro-batch to pack
        self._file_pos = 0
        self._carry = b""  # remainder of a split document
        self._pieces: list[bytes] = []

    # ------------------------------------------------------------ documents
    def _next_piece(self) -> bytes:
        """The next document (or document piece of at most max_doc_tokens)."""
        while not self._pieces:
            if self._file_pos >= len(self.files):
                self._file_pos = 0  # epoch wrap: same order again
            path = self.files[self._file_pos]
            self._file_pos += 1
            try:
                raw = path.read_bytes()
            except OSError:
                continue
            if len(raw) < self.min_doc_tokens:
                continue
            m = self.max_doc_tokens
            self._pieces = [raw[i : i + m] for i in range(0, len(raw), m)]
            self._pieces = [p for p in self._pieces if len(p) >= self.min_doc_tokens] or [raw[:m]]
        return self._pieces.pop(0)

    def budget_of(self, index: int) -> int:
        if not self.token_budgets:
            return self.token_budget
        return random.Random(self.seed * 1_000_003 + index).choice(self.token_budgets)

    def _pack_one(self) -> PackedMicroBatch:
        n = self.budget_of(self._next)
        segs: list[bytes] = []
        left = n
        while left > 0:
            piece = self._carry or self._next_piece()
            self._carry = b""
            if len(piece) <= left:
                segs.append(piece)
                left -= len(piece)
            else:
                segs.append(piece[:left])
                rest = piece[left:]
                # A 1-token remainder has no next-token target; drop it.
                self._carry = rest if len(rest) >= self.min_doc_tokens else b""
                left = 0
        tokens = np.frombuffer(b"".join(segs), dtype=np.uint8).astype(np.int64)
        targets = np.empty_like(tokens)
        pos = 0
        for s in segs:
            seg = tokens[pos : pos + len(s)]
            targets[pos : pos + len(s) - 1] = seg[1:]
            targets[pos + len(s) - 1] = IGNORE_INDEX
            pos += len(s)
        return PackedMicroBatch(
            index=self._next,
            tokens=tokens,
            targets=targets,
            doc_lens=tuple(len(s) for s in segs),
        )

    def microbatch(self, index: int) -> PackedMicroBatch:
        """Global micro-batch ``index`` (packed on demand, then cached)."""
        if index < 0:
            raise ValueError(f"micro-batch index must be >= 0, got {index}")
        if self.repeat_index >= 0:
            index = self.repeat_index
        if index in self._packed:
            return self._packed[index]
        if index < self._next:  # evicted: packing is sequential, so start over
            self._reset_packer()
        while self._next <= index:
            self._packed[self._next] = self._pack_one()
            self._packed.pop(self._next - self.cache_window, None)
            self._next += 1
        return self._packed[index]
