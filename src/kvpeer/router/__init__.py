"""``kvpeer router``: an OpenAI-compatible HTTP router in front of vLLM engines that run
the kvpeer tier. It decides, per request, which engine serves it and which peer that
engine pulls from (``kv_transfer_params``), from what each engine reports it holds.

Modules: :mod:`.policy` (the contract between the HTTP edge and the decision core),
the decision core (index of what each engine holds, cost model) and the HTTP edge.
"""
