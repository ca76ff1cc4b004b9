"""The fleet model (``kvpeer lab fleet``): simulated GPU engines driving the router's code.

:mod:`~kvpeer.lab.fleet.params` holds the hardware and model figures (each one cited or
marked as an assumption), :mod:`~kvpeer.lab.fleet.lru` the caches,
:mod:`~kvpeer.lab.fleet.link` the network, :mod:`~kvpeer.lab.fleet.engine` one engine,
:mod:`~kvpeer.lab.fleet.world` the event loop that sends a trace through the router's
real policy (or a bound) to the engines, and :mod:`~kvpeer.lab.fleet.grid` the runs at
several fleet sizes, loads and links. See docs/fleet.md.
"""
