"""The device check's ``ngram`` step: SGLang's n-gram corpus (the C++ trie behind NGRAM and GLANCE's n-gram
source) built and matched once, or a line saying that the n-gram source is off where SGLang is not installed
(the lent accelerator machine's image has no SGLang): exit status 3, which the check reports as "off".

    python tests/gpu/device_ngram.py
"""

from __future__ import annotations

import importlib.util
import sys
import time

OFF = 3  # the check's "off, not failed" status


def main() -> int:
    if importlib.util.find_spec("sglang") is None:
        print("  n-gram source off: sglang is not installed here (the corpus is SGLang's NgramCorpus, C++)")
        return OFF
    from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus

    t0 = time.monotonic()
    corpus = NgramCorpus(max_trie_depth=8, draft_token_num=4)  # JIT-builds the C++ module on first use
    text = [5, 6, 7, 8, 9, 10, 11, 12] * 4
    corpus.batch_put([text])
    corpus.synchronize()
    drafts, mask = corpus.batch_get(["probe"], [text[:6]], [6])
    print(f"  NgramCorpus built and matched in {time.monotonic() - t0:.1f} s: drafts {list(drafts)}, "
          f"mask {getattr(mask, 'shape', None)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
