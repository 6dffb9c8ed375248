"""Integrity of reused K/V: every full block the model writes gets a reference digest,
and every block the cache hands back for reuse is digested again and compared.

A block is identified by its token prefix (a chain of xxh3-128 over the tokens, like
the cache's own index but computed independently here). Its digest is a weighted sum
of the block's 32-bit words with random odd 64-bit weights (mod 2**64), computed on
the cache's device so the blocks never leave it: any change of one word changes the
digest, and a different block collides with probability about 2**-63.

The same prefix can legitimately be computed more than once (two requests in one
step, or again after the cache dropped it), and float32 results may differ in the
last bit with the batch shape, so a prefix keeps every digest written for it; a
reused block must match one of them.

A replica of several also reuses blocks that another replica computed (the remote
tier): their references are in that replica's ledger. ``defer=True`` keeps a block
that matches none of this ledger's references for :meth:`settle`, which checks it at
the end of the run against every replica's references of the same TP rank."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from ...layout import KVLayout

_CHUNK_BYTES = 64 << 20  # bound on the digest's int64 temporaries


@dataclass(slots=True)
class _SeqKeys:
    tokens: np.ndarray  # int32, every token whose K/V is (or is being) written
    keys: list[bytes] = field(default_factory=list)  # prefix key of each full block
    written: int = 0  # tokens whose K/V were written (queued)


class BlockLedger:
    """Reference digests by prefix key; per-sequence keys, and the digest shares of each
    sequence's partial last block (``_open``) until the block completes."""

    def __init__(self, layout: KVLayout, device: torch.device, seed: int = 0, defer: bool = False):
        self.tpb = layout.tokens_per_block
        nbytes = layout.bytes_per_block
        self._word = torch.int32 if nbytes % 4 == 0 else torch.uint8
        words = nbytes // (4 if self._word == torch.int32 else 1)
        g = torch.Generator().manual_seed(0x6B76 + seed)
        w = torch.randint(-(1 << 62), 1 << 62, (words,), generator=g, dtype=torch.int64) | 1
        self._weights = w.to(device)
        self._chunk = max(1, _CHUNK_BYTES // (8 * words))
        # The weights by token: [position in the block, the token's words] (a block is
        # [layer, K|V, token, head, dim]; a token's words are whole: heads x dim x itemsize
        # is a multiple of the word).
        word_bytes = nbytes // words
        assert layout.num_kv_heads * layout.head_dim * layout.itemsize % word_bytes == 0, "a token's words"
        per = layout.num_kv_heads * layout.head_dim * layout.itemsize // word_bytes
        self._token_weights = (w.view(layout.num_layers, 2, self.tpb, per).permute(2, 0, 1, 3)
                               .reshape(self.tpb, -1).contiguous().to(device))
        self._token_chunk = max(1, _CHUNK_BYTES // (8 * self._token_weights.shape[1]))
        self._open: dict[Hashable, int] = {}  # sequence -> digest shares of its partial block
        self._pending: dict[Hashable, int] = {}  # sequence -> runs queued, not yet recorded
        self.ref: dict[bytes, tuple[int, ...]] = {}
        self.seqs: dict[Hashable, _SeqKeys] = {}
        self.checked_blocks = 0
        self.mismatched_blocks = 0
        self.unknown_blocks = 0  # reused blocks that were never written (also mismatches)
        self.variants = 0  # prefixes written with more than one distinct digest
        self.first_mismatch: str | None = None
        self.defer = defer
        self.deferred: dict[bytes, set[int]] = {}  # prefix key -> digests read back, unmatched here
        self.deferred_where: dict[bytes, str] = {}  # prefix key -> where it was first read

    # -- digests ------------------------------------------------------------------------------------
    def digest(self, blocks: torch.Tensor) -> list[int]:
        """Digests of ``blocks [n, layers, 2, tpb, heads, dim]`` (the cache's block layout)."""
        return self.digest_queued(blocks).tolist()

    def digest_queued(self, blocks: torch.Tensor) -> torch.Tensor:
        """``digest`` as an int64 tensor on the blocks' device, not waited for."""
        n = blocks.shape[0]
        words = blocks.contiguous().view(n, -1).view(self._word)
        out = [(words[lo: lo + self._chunk].to(torch.int64) * self._weights).sum(dim=1)
               for lo in range(0, n, self._chunk)]
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64, device=blocks.device)

    @staticmethod
    def _chain(parent: bytes, tokens: np.ndarray) -> bytes:
        return xxhash.xxh3_128_digest(parent + tokens.tobytes())

    def _extend_keys(self, sk: _SeqKeys) -> None:
        for i in range(len(sk.keys), len(sk.tokens) // self.tpb):
            parent = sk.keys[-1] if sk.keys else b""
            sk.keys.append(self._chain(parent, sk.tokens[i * self.tpb: (i + 1) * self.tpb]))

    # -- the sequence's life ------------------------------------------------------------------------
    def admit(self, seq_id: Hashable, prompt: np.ndarray) -> None:
        sk = _SeqKeys(np.asarray(prompt, dtype=np.int32))
        self._extend_keys(sk)
        self.seqs[seq_id] = sk

    def keys(self, seq_id: Hashable, n: int) -> list[bytes]:
        """The prefix keys of the sequence's first ``n`` blocks."""
        return self.seqs[seq_id].keys[:n]

    def check_reused(self, seq_id: Hashable, digests: list[int]) -> int:
        """Compare the digests of the sequence's first ``len(digests)`` blocks, as read
        back from the cache, with the references. Returns how many mismatch."""
        return self.check_keys(seq_id, self.keys(seq_id, len(digests)), digests)

    def check_keys(self, seq_id: Hashable, keys: list[bytes], digests: list[int]) -> int:
        """``check_reused`` with the blocks' prefix keys taken earlier (the sequence may
        be gone by the time its digests are read back)."""
        bad = 0
        for i, (key, d) in enumerate(zip(keys, digests, strict=True)):
            known = self.ref.get(key)
            if known is not None and d in known:
                continue
            if self.defer:
                self.deferred.setdefault(key, set()).add(d)
                self.deferred_where.setdefault(key, f"sequence {seq_id!r} block {i}")
                continue
            bad += 1
            self._mismatch(f"sequence {seq_id!r} block {i}", known is not None)
        self.checked_blocks += len(digests)
        self.mismatched_blocks += bad
        return bad

    def _mismatch(self, where: str, known: bool) -> None:
        self.unknown_blocks += not known
        if self.first_mismatch is None:
            why = "bytes differ from every write" if known else "never written"
            self.first_mismatch = f"{where}: {why}"

    def settle(self, refs: list[dict[bytes, tuple[int, ...]]]) -> int:
        """Check the deferred blocks against ``refs`` (the references of the other
        replicas' ranks with this rank's TP index) and this ledger's own; returns, and
        counts as mismatched, the blocks read back with bytes no replica wrote."""
        bad = unmatched(self.deferred, [self.ref, *refs])
        for key in bad:
            self._mismatch(self.deferred_where[key] + " (reused from another replica)",
                           any(key in r for r in (self.ref, *refs)))
        self.deferred.clear()
        self.mismatched_blocks += len(bad)
        return len(bad)

    def written(self, seq_id: Hashable, start: int, kv: torch.Tensor,
                appended: np.ndarray | None = None) -> None:
        """Record the K/V ``kv [n, L, 2, H, D]`` the model wrote at positions ``start ..``;
        every block they complete gets a reference digest. ``appended`` are decoded
        tokens not yet in the sequence's token list."""
        keys = self.queue_written(seq_id, start, len(kv), appended)
        self.record_tokens([(seq_id, start, len(kv), keys)],
                           self.token_digests(kv, self.positions([(start, len(kv))])).tolist())

    def queue_written(self, seq_id: Hashable, start: int, n: int,
                      appended: np.ndarray | None = None) -> list[bytes]:
        """The host half of ``written``: the sequence's tokens and prefix keys move on
        now; returns the prefix keys of the blocks that positions ``start .. start + n``
        complete. Their digests are ``token_digests``' of the same K/V, summed a block
        at a time by ``record_tokens`` once they are on the host."""
        sk = self.seqs[seq_id]
        if appended is not None:
            sk.tokens = np.concatenate([sk.tokens, np.asarray(appended, dtype=np.int32)])
            self._extend_keys(sk)
        # A prefill may begin after a reused prefix (whole blocks), else where the last left off.
        whole = start % self.tpb == 0 and sk.written % self.tpb == 0
        assert start == sk.written or (start > sk.written and whole), \
            f"sequence {seq_id!r} wrote up to {sk.written}, not {start}"
        sk.written = start + n
        self._pending[seq_id] = self._pending.get(seq_id, 0) + 1
        return sk.keys[start // self.tpb: (start + n) // self.tpb]

    def positions(self, runs: list[tuple[int, int]]) -> np.ndarray:
        """Each token's position in its block, for runs ``(start, n)`` laid end to end."""
        if not runs:
            return np.zeros(0, dtype=np.int64)
        starts = np.array([s for s, _ in runs], dtype=np.int64)
        lens = np.array([n for _, n in runs], dtype=np.int64)
        first = np.repeat(np.cumsum(lens) - lens, lens)
        return (np.repeat(starts, lens) + np.arange(int(lens.sum())) - first) % self.tpb

    def token_digests(self, kv: torch.Tensor, positions: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Per token of ``kv [n, L, 2, H, D]`` its share of its block's digest (its words
        times the weights of its ``positions`` in the block), an int64 tensor on the
        device, not waited for: a block's digest is the sum of its tokens' shares (mod
        2**64), so a step digests every token it wrote in a few kernels, whichever
        sequences and blocks they belong to."""
        n = kv.shape[0]
        out = torch.empty(n, dtype=torch.int64, device=kv.device)
        if not n:
            return out
        pos = positions if isinstance(positions, torch.Tensor) else torch.from_numpy(positions).to(kv.device)
        words = kv.reshape(n, -1).view(self._word)
        for lo in range(0, n, self._token_chunk):
            hi = lo + self._token_chunk
            out[lo:hi] = (words[lo:hi].to(torch.int64) * self._token_weights[pos[lo:hi]]).sum(dim=1)
        return out

    def record_tokens(self, runs: list[tuple[Hashable, int, int, list[bytes]]], shares) -> None:
        """The reference digests of the blocks ``runs`` (``queue_written``'s, in the
        order they were queued; ``shares``: ``token_digests`` of their tokens end to end,
        on the host) completed; a block begun in an earlier run is carried over."""
        shares = np.asarray(shares, dtype=np.int64)
        at = 0
        for seq_id, start, n, keys in runs:
            mine = shares[at: at + n]
            at += n
            cut = (-start) % self.tpb  # tokens that end the block begun before this run
            edges = np.arange(min(cut, n), n, self.tpb) if cut else np.arange(0, n, self.tpb)
            sums = (np.add.reduceat(mine, np.concatenate([[0], edges]) if cut else edges)
                    if n else np.zeros(0, dtype=np.int64)).tolist()
            if sums:
                sums[0] = _int64(sums[0] + self._open.pop(seq_id, 0))
            whole = sums[:len(sums) - bool((start + n) % self.tpb)]
            assert len(whole) == len(keys), "blocks completed out of step with their keys"
            for key, d in zip(keys, whole):
                self._record_one(key, d)
            if (start + n) % self.tpb:
                self._open[seq_id] = sums[-1]
            left = self._pending[seq_id] - 1
            if left:
                self._pending[seq_id] = left
            else:
                del self._pending[seq_id]
                if seq_id not in self.seqs:  # released: its partial block is never completed
                    self._open.pop(seq_id, None)

    def _record_one(self, key: bytes, d: int) -> None:
        known = self.ref.get(key)
        if known is None:
            self.ref[key] = (d,)
        elif d not in known:
            self.ref[key] = (*known, d)
            self.variants += len(known) == 1

    @property
    def partial_blocks(self) -> int:
        """Sequences whose last block's digest shares are held until it completes."""
        return len(self._open)

    def check_invariants(self) -> None:
        """A partial block is held only for a live sequence or one with digests queued."""
        for seq_id in self._open:
            assert seq_id in self.seqs or seq_id in self._pending, f"{seq_id!r}'s partial block outlived it"
        assert all(n > 0 for n in self._pending.values()), "a sequence with no queued digests is pending"

    def release(self, seq_id: Hashable) -> None:
        del self.seqs[seq_id]
        if seq_id not in self._pending:  # else dropped once its last queued digests are recorded
            self._open.pop(seq_id, None)


def _int64(x: int) -> int:
    """``x`` mod 2**64 as a signed 64-bit value (what the device's int64 sums give)."""
    return ((x + (1 << 63)) & ((1 << 64) - 1)) - (1 << 63)


def unmatched(deferred: dict[bytes, set[int]], refs: list[dict[bytes, tuple[int, ...]]]) -> list[bytes]:
    """Keys of ``deferred`` blocks with a digest that no ledger of ``refs`` recorded."""
    bad = []
    for key, digests in deferred.items():
        known: set[int] = set()
        for r in refs:
            known.update(r.get(key, ()))
        if digests - known:
            bad.append(key)
    return bad
