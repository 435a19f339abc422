"""Exact and near-duplicate detection for the streaming dataset cleaner.

Why: in fine-tuning data a repeated example is over-weighted (the loss sees it several times per epoch and the
model memorises it), and a copy that lands on both sides of the train/val split leaks into validation and makes
the validation loss look better than it is. Near duplicates (a changed word, different punctuation or spacing)
do the same harm, so they are caught too.

The cleaner streams up to ~1M examples one by one, so only compact fingerprints of the kept texts are stored,
never the texts:

- exact: a 16-byte blake2b digest per kept text.
- near: the exact check first, then MinHash over 5-character shingles of a normalised form (NFKC, lowercase,
  whitespace, punctuation and symbols removed; characters rather than words, so Chinese needs no segmentation).
  LSH banding finds candidate texts, and every candidate is confirmed by comparing stored signatures, so a text
  is flagged only when the estimated Jaccard similarity reaches the threshold.
"""

from __future__ import annotations

import hashlib
import math
import re
import sys
import unicodedata
from functools import cache
from typing import TYPE_CHECKING, Literal, cast

import numpy as np

if TYPE_CHECKING:
    from typing_extensions import Buffer

Mode = Literal["none", "exact", "near"]
Verdict = Literal["duplicate", "near_duplicate"]

_BIN_BITS = 7  # at most 7: donor ranks and the empty flag share a uint8 in `_signature`
NUM_PERM = 1 << _BIN_BITS  # MinHash values per signature; the estimate's std is ~sqrt(J(1-J)/128), 0.027 at J = 0.9
SHINGLE = 5  # characters per shingle
MIN_RECALL_AT_THRESHOLD = 0.98  # chance that a pair exactly at the threshold becomes an LSH candidate

_EMPTY_BIN = np.uint64(2**64 - 1)
_BIN_SHIFT = np.uint64(64 - _BIN_BITS)  # the top bits of a shingle hash pick its bin
_VALUE_SHIFT = np.uint64(32)  # the top 32 bits are the strongly universal part of the multilinear hash
_PAD = np.full(SHINGLE, sys.maxunicode + 1, dtype=np.uint32)  # fills short texts up to one shingle; no real char
_TABLE_TAIL = 1024  # free slots past the last home slot and the last entry: probes run on instead of wrapping round
_BLOCK_BITS = 16  # signatures are kept in blocks of 2**16 (16 MiB): growing never copies, at most one is part-used
_LOW32 = 0xFFFFFFFF
_RANK_PENALTY = np.uint8(_BIN_BITS)  # empty-bin flag << 7 = 128, above every donor rank (0..127)
# Fullwidth ASCII variants and the ideographic space, whose NFKC form is their plain counterpart. Chinese text nearly
# always has "，", which sends NFKC down its slow path (~20 us per 150 characters); mapping these first is exact and
# usually leaves a string that NFKC's quick check accepts.
_FULLWIDTH = re.compile("[\uff01-\uff5e\u3000]")
_HALFWIDTH = {chr(c): chr(c - 0xFEE0) for c in range(0xFF01, 0xFF5F)} | {"\u3000": " "}


@cache
def _kept_chars() -> np.ndarray:
    """A lookup table, by code point, of the characters that survive normalisation (built once per process)."""
    keep = np.ones(sys.maxunicode + 1, dtype=bool)
    dropped = [c for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c))[0] in "PS" or chr(c).isspace()]
    keep[dropped] = False
    return keep


def _random_words(seed: int, purpose: str, count: int) -> np.ndarray:
    """`count` random uint64 from SHAKE-256 of the seed: the same in every process and with every numpy version."""
    return np.frombuffer(hashlib.shake_256(f"dedup:{seed}:{purpose}".encode()).digest(8 * count), dtype="<u8")


def lsh_bands(threshold: float, num_perm: int = NUM_PERM) -> tuple[int, int]:
    """(bands, rows): the most rows per band (fewest index entries, fewest dissimilar candidates) that still make a
    pair with Jaccard similarity == threshold a candidate with probability >= MIN_RECALL_AT_THRESHOLD."""
    for rows in range(num_perm, 0, -1):
        bands = num_perm // rows
        if 1 - (1 - threshold**rows) ** bands >= MIN_RECALL_AT_THRESHOLD:
            return bands, rows
    return num_perm, 1  # threshold below ~0.03: one value per band, the most candidates LSH can give


class _BandTable:
    """Multimap from LSH band key to the row of the kept example, in one flat uint64 array (linear probing).

    Why not a dict of lists: with ~10-20 band keys per kept example a Python dict costs ~100 bytes an entry (over
    a gigabyte at 1M examples); here an entry is one 8-byte word, at a load factor between 1/4 and 1/2.
    Word = (top 32 bits of the band key) << 32 | (row + 1); 0 marks a free slot. The home slot of a key is its top
    `bits` bits, which the word keeps (bits <= 32, i.e. up to 2**31 entries), so the table grows without the keys.
    """

    def __init__(self) -> None:
        self._count = 0
        self._words = np.zeros(0, dtype=np.uint64)
        self._view = _words_view(self._words)
        self._resize(16)

    def _resize(self, bits: int) -> None:
        words = self._words[self._words != 0]
        del self._view, self._words  # free the old table before the new one is made: ~130 MB at 1M examples
        words.sort()  # by home slot, the top bits
        # Re-inserted in home order, entry i lands on max(its home, slot of entry i-1 + 1): a running maximum.
        rank = np.arange(words.size, dtype=np.int64)
        slots = (words >> np.uint64(64 - bits)).view(np.int64)
        slots -= rank
        np.maximum.accumulate(slots, out=slots)
        slots += rank
        self._bits = bits
        self._shift = 64 - bits
        self._words = np.zeros(max(1 << bits, slots[-1] + 1 if words.size else 0) + _TABLE_TAIL, dtype=np.uint64)
        self._words[slots] = words
        self._view = _words_view(self._words)  # plain-int access: a few probes per key beat numpy's per-call cost

    def probe(self, keys: list[int]) -> tuple[set[int], list[int]]:
        """The rows stored under any of `keys` (a 32-bit tag collision is possible: the caller confirms them), and
        for each key the free slot that ends its run, where `add` can put it."""
        found: set[int] = set()
        ends = []
        view = self._view
        shift = self._shift
        for key in keys:
            tag = key >> 32
            slot = key >> shift
            while word := view[slot]:
                if word >> 32 == tag:
                    found.add((word & _LOW32) - 1)
                slot += 1
            ends.append(slot)
        return found, ends

    def add(self, keys: list[int], ends: list[int], row: int) -> None:
        """Store `row` under `keys`; `ends` from the `probe` of the same keys, with nothing added in between."""
        if 2 * (self._count + len(keys)) > 1 << self._bits:
            self._resize(self._bits + 1)
            ends = [key >> self._shift for key in keys]
        view = self._view
        for key, slot in zip(keys, ends):
            while view[slot]:  # taken by an earlier key of the same row
                slot += 1
            if slot == len(view) - 1:  # the run reached the end (the last slot stays free to stop every probe)
                self._words = np.concatenate([self._words, np.zeros(_TABLE_TAIL, dtype=np.uint64)])
                self._view = view = _words_view(self._words)
            view[slot] = (key >> 32 << 32) | (row + 1)
        self._count += len(keys)


class Deduplicator:
    """Streaming duplicate detector: `check` each example once, in order; only kept examples are remembered.

    Memory per kept example: a 16-byte digest in a set (~100 bytes with Python's object and set overhead); in mode
    "near" also a NUM_PERM x uint16 signature (256 bytes) and one 8-byte band-table word per band at load 1/4..1/2
    (11 bands at the default threshold 0.9: 176-352 bytes). About 0.5-0.7 KB in all in mode "near", ~0.6 GB at
    1M kept examples, plus up to one part-used 16 MiB block of signatures.
    """

    def __init__(self, mode: Mode = "exact", threshold: float = 0.9, seed: int = 0) -> None:
        if mode not in ("none", "exact", "near"):
            raise ValueError(f"dedup mode must be 'none', 'exact' or 'near', not {mode!r}")
        if not 0 < threshold <= 1:
            raise ValueError(f"dedup threshold must be in (0, 1], not {threshold}")
        self.mode = mode
        self.threshold = threshold
        self._digests: set[bytes] = set()
        if mode != "near":
            return
        self._keep = _kept_chars()
        # Multilinear hash of a shingle's code points: (m0 + sum m_k c_k) mod 2**64, whose top 32 bits are a
        # strongly universal (pairwise independent) hash; stable across processes, unlike Python's hash().
        self._shingle_mult = _random_words(seed, "shingle", SHINGLE).astype(np.uint64)
        self._shingle_add = _random_words(seed, "offset", 1).astype(np.uint64)[0]
        # Optimal densification: an empty bin copies the first non-empty bin of its own fixed random order of bins;
        # _donor_rank[i, j] is the place of bin j in the order of bin i (the rank of a random word in row i).
        words = _random_words(seed, "donors", NUM_PERM * NUM_PERM).reshape(NUM_PERM, NUM_PERM)
        self._donor_rank = np.argsort(np.argsort(words, axis=1), axis=1).astype(np.uint8)
        self._no_minima = np.full(NUM_PERM, _EMPTY_BIN)
        bands, rows = lsh_bands(threshold)
        # Band keys by one matrix product: band b is a random linear combination of its `rows` minhash values.
        band_words = _random_words(seed, "bands", bands * rows).reshape(bands, rows)
        self._band_mult = np.zeros((bands, NUM_PERM), dtype=np.uint64)
        for band in range(bands):
            self._band_mult[band, band * rows : (band + 1) * rows] = band_words[band]
        self._min_equal = math.ceil(round(threshold * NUM_PERM, 9))
        self._blocks: list[np.ndarray] = []  # NUM_PERM x uint16 signatures of the kept examples, by row
        self._kept = 0
        self._table = _BandTable()

    def check(self, text: str) -> Verdict | None:
        """None when `text` is new (it is then remembered); 'duplicate' when an identical text was seen;
        'near_duplicate' (mode 'near' only) when a remembered text has estimated Jaccard similarity >= threshold."""
        if self.mode == "none":
            return None
        digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        if digest in self._digests:
            return "duplicate"
        if self.mode == "near":
            signature = self._signature(text)
            keys = (self._band_mult @ signature).tolist()
            candidates, ends = self._table.probe(keys)
            if candidates and self._any_similar(candidates, signature):
                return "near_duplicate"
            self._remember(signature, keys, ends)
        self._digests.add(digest)
        return None

    def _signature(self, text: str) -> np.ndarray:
        """One-permutation MinHash with optimal densification (Shrivastava 2017): one hash per shingle, whose top
        bits pick one of NUM_PERM bins; a bin keeps its minimum, and an empty bin copies another bin. The Jaccard
        estimate stays unbiased at one hash per shingle instead of NUM_PERM (one (a*x+b) hash function per bin
        costs NUM_PERM times the hashing: benchmarks/README.md, data preparation). Returns the top 32 bits of the
        NUM_PERM minima."""
        if not unicodedata.is_normalized("NFKC", text):
            text = unicodedata.normalize("NFKC", _FULLWIDTH.sub(lambda m: _HALFWIDTH[m[0]], text))
        normal = text.lower()
        points = np.frombuffer(normal.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        points = points[self._keep[points]]
        if points.size < SHINGLE:  # a short text is one shingle: itself (empty for only punctuation and spaces)
            points = np.concatenate([points, _PAD[: SHINGLE - points.size]])
        hashes = np.correlate(points, self._shingle_mult, "valid")
        hashes += self._shingle_add
        minima = self._no_minima.copy()
        np.minimum.at(minima, hashes >> _BIN_SHIFT, hashes)
        empty = minima == _EMPTY_BIN  # ~40 of 128 bins at 150 shingles; none only past ~600
        ranks = self._donor_rank[empty]
        ranks |= empty.view(np.uint8) << _RANK_PENALTY
        minima[empty] = minima[ranks.argmin(axis=1)]
        return minima >> _VALUE_SHIFT

    def _any_similar(self, rows: set[int], signature: np.ndarray) -> bool:
        """Confirm LSH candidates: the fraction of equal (16-bit) minhash values estimates the Jaccard similarity."""
        low = (1 << _BLOCK_BITS) - 1
        stored = np.stack([self._blocks[row >> _BLOCK_BITS][row & low] for row in rows])
        equal = np.count_nonzero(stored == signature.astype(np.uint16), axis=1)
        return bool(equal.max() >= self._min_equal)

    def _remember(self, signature: np.ndarray, keys: list[int], ends: list[int]) -> None:
        block, offset = divmod(self._kept, 1 << _BLOCK_BITS)
        if not offset:
            self._blocks.append(np.empty((1 << _BLOCK_BITS, NUM_PERM), dtype=np.uint16))
        self._blocks[block][offset] = signature  # truncated to the low 16 bits: 256 bytes per kept example
        self._table.add(keys, ends, self._kept)
        self._kept += 1


def _words_view(words: np.ndarray) -> memoryview:
    """The table as a memoryview: plain Python ints per slot (numpy's stubs do not declare arrays buffers)."""
    return memoryview(cast("Buffer", words))
