"""Independent ports of the official selection rules of Quest, SparQ, Twilight, H2O and StreamingLLM (issue #39).

Each module re-implements, in this project's own code, what one method's official code selects at a decode step, so
that ``sparsedecode``'s selectors can be checked against it. Nothing here is copied from those repositories; each
docstring cites the repository, file, function and commit read. See ``README.md`` in this folder for the memo.

Shared conventions: ``queries`` ``(H, d)`` are the current token's post-RoPE queries, ``keys`` ``(KV, N, d)`` the
post-RoPE cache with the current token's key last (position ``N - 1``); query head ``h`` reads KV head ``h // G``
with ``G = H / KV`` (``repeat_kv``'s layout). Every port returns, for every query head, the ascending positions it
attends to (a list of ``H`` LongTensors). Where the official code breaks ties with ``torch.topk`` (whose order among
equal values is not specified), a port takes the lowest index first, as this project does.
"""
