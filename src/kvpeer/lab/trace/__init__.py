"""Production request traces in Mooncake's FAST'25 format, for the fleet model and replays.

:mod:`~kvpeer.lab.trace.mooncake` reads a trace file, :mod:`~kvpeer.lab.trace.reuse`
says how much of it any cache could save, :mod:`~kvpeer.lab.trace.scaling` fits it to
a served model and a machine, and :mod:`~kvpeer.lab.trace.tokens` turns its block ids
into token ids.
"""
