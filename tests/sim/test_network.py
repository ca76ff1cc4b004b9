"""The simulation's network: each fault kind shows a node what ZMQ over TCP would.

Rules as numbered in :mod:`kvpeer.lab.sim.sim_network`: death and refused connects (1),
a host that does not exist (2), partitions (3), frozen processes (4).
"""

from __future__ import annotations

import random

import pytest

from kvpeer.lab.sim.sim_network import ZMQ_HANDSHAKE_S, Heartbeat, SimControl, SimNetwork
from kvpeer.testing.clock import FakeClock

HEARTBEAT = Heartbeat(interval=0.2, timeout=1.0)
DELAY = 0.05


class Net:
    def __init__(self) -> None:
        self.clock = FakeClock()
        self.net = SimNetwork(self.clock, lambda a, b: DELAY, HEARTBEAT, random.Random(1))
        self.a = self.net.attach("a")
        self.b = self.net.attach("b")

    def after(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.net.update()


def frames(control: SimControl) -> list[bytes]:
    return [inbound.frame for inbound in control.receive()]


@pytest.fixture
def net() -> Net:
    return Net()


class TestHealthy:
    def test_frames_arrive_in_order_after_the_delay(self, net: Net) -> None:
        link = net.a.connect("b")
        assert link.transmit(b"1")
        assert link.transmit(b"2")
        assert frames(net.b) == []
        net.after(DELAY)
        assert frames(net.b) == [b"1", b"2"]

    def test_a_next_link_never_overtakes_an_earlier_one(self) -> None:
        # A slow frame on a link that then closes, and a fast one on the next link:
        # the peer's ROUTER reads the old connection's frames first (ZMQ rules 6, 7).
        # Seed 1005440: an ended session's lookup overtaken by the next session's
        # connect was taken in by that session, its producer entry never closed.
        delays = iter([0.3, 0.01])
        clock = FakeClock()
        net = SimNetwork(clock, lambda a, b: next(delays), HEARTBEAT, random.Random(1))
        a, b = net.attach("a"), net.attach("b")
        old = a.connect("b")
        assert old.transmit(b"old session's lookup")
        old.close()
        clock.advance(0.1)
        net.update()
        new = a.connect("b")
        assert new.transmit(b"next session's connect")
        clock.advance(0.2)
        net.update()
        assert frames(b) == [b"old session's lookup", b"next session's connect"]


class TestDeathAndRefusal:
    def test_a_link_to_a_dead_process_dies_at_the_next_update(self, net: Net) -> None:
        link = net.a.connect("b")
        net.net.kill("b")
        net.after(0.01)
        assert not link.alive
        assert link.dead == "connection lost (the peer ended)"

    def test_a_connect_to_a_dead_process_is_refused(self, net: Net) -> None:
        net.net.kill("b")
        link = net.a.connect("b")
        net.after(0.01)
        assert link.dead == "connection refused"

    def test_a_restart_on_the_same_address_ends_links_to_the_old_process(self, net: Net) -> None:
        old = net.a.connect("b")
        net.net.kill("b")
        fresh_b = net.net.attach("b")
        net.after(0.01)
        assert not old.alive
        new = net.a.connect("b")
        assert new.transmit(b"hello")
        net.after(DELAY)
        assert new.alive
        assert frames(fresh_b) == [b"hello"]

    def test_a_host_that_does_not_exist_never_answers_nor_refuses(self, net: Net) -> None:
        link = net.a.connect("nobody")
        assert link.transmit(b"connect")
        net.after(600.0)
        assert link.alive
        assert link.connected_at is None


class TestPartition:
    def test_frames_are_held_and_delivered_when_a_short_cut_heals(self, net: Net) -> None:
        link = net.a.connect("b")
        net.net.cut("a", "b")
        assert link.transmit(b"during")
        net.after(0.5)
        assert frames(net.b) == []
        net.net.heal("a", "b")
        net.after(0.0)  # the next update retransmits; the frame is then in flight
        net.after(DELAY)
        assert link.alive
        assert frames(net.b) == [b"during"]

    def test_only_the_cut_direction_is_held(self, net: Net) -> None:
        a_to_b, b_to_a = net.a.connect("b"), net.b.connect("a")
        net.net.cut("a", "b")
        a_to_b.transmit(b"held")
        b_to_a.transmit(b"flows")
        net.after(DELAY)
        assert frames(net.a) == [b"flows"]
        assert frames(net.b) == []

    @pytest.mark.parametrize("direction", [("a", "b"), ("b", "a")])
    def test_a_long_cut_either_way_kills_connected_links_by_heartbeat(
        self, net: Net, direction: tuple[str, str]
    ) -> None:
        a_to_b, b_to_a = net.a.connect("b"), net.b.connect("a")
        net.net.cut(*direction)
        net.after(HEARTBEAT.timeout - 0.01)
        assert a_to_b.alive
        assert b_to_a.alive
        net.after(HEARTBEAT.interval + 0.02)
        assert a_to_b.dead == b_to_a.dead == "heartbeat timeout"
        net.net.heal(*direction)
        net.after(1.0)
        assert not a_to_b.alive  # never reconnected: the session layer starts over

    def test_a_cut_turning_around_in_one_tick_does_not_reset_the_heartbeat(self, net: Net) -> None:
        link = net.a.connect("b")
        net.net.cut("a", "b")
        net.after(HEARTBEAT.timeout / 2)
        net.net.heal("a", "b")  # and, before any heartbeat could cross:
        net.net.cut("b", "a")
        # Past the detection from the first cut, well before it from the second:
        net.after(HEARTBEAT.longest_detection - HEARTBEAT.timeout / 2 + 0.01)
        assert link.dead == "heartbeat timeout"

    def test_a_link_dialled_across_a_cut_waits_and_connects_when_it_heals(self, net: Net) -> None:
        net.net.cut("b", "a")  # the SYN goes out, its answer is lost
        link = net.a.connect("b")
        link.transmit(b"connect")
        net.after(60.0)
        assert link.alive
        assert link.connected_at is None
        assert frames(net.b) == []
        net.net.heal("b", "a")
        net.after(0.0)
        assert link.connected_at is not None
        net.after(DELAY)
        assert frames(net.b) == [b"connect"]

    def test_a_dead_peer_behind_a_cut_is_silent_not_refused(self, net: Net) -> None:
        link = net.a.connect("b")
        net.net.cut("a", "b")
        net.net.kill("b")
        net.after(0.5)
        assert link.alive  # the reset cannot reach us
        net.after(HEARTBEAT.longest_detection)
        assert link.dead == "heartbeat timeout"


class TestFreeze:
    def test_frames_wait_for_a_frozen_peer_until_the_heartbeat_gives_up(self, net: Net) -> None:
        link = net.a.connect("b")
        net.net.freeze("b")
        link.transmit(b"buffered")  # its kernel takes it
        net.after(HEARTBEAT.longest_detection + 0.01)
        assert link.dead == "heartbeat timeout"
        net.net.thaw("b")
        assert frames(net.b) == [b"buffered"]

    def test_a_link_dialled_to_a_frozen_peer_dies_with_the_zmq_handshake(self, net: Net) -> None:
        net.net.freeze("b")
        link = net.a.connect("b")
        link.transmit(b"connect")
        net.after(ZMQ_HANDSHAKE_S - 0.1)
        assert link.alive
        assert link.connected_at is None
        net.after(0.2)
        assert link.dead == "ZMQ handshake timed out (the peer does not answer)"

    def test_a_long_freeze_ends_the_frozen_side_links_too(self, net: Net) -> None:
        b_to_a = net.b.connect("a")
        net.net.freeze("b")
        net.after(HEARTBEAT.timeout + 0.5)
        assert b_to_a.alive  # b sees nothing while it is stopped
        net.net.thaw("b")
        assert b_to_a.dead is not None
        assert "TTL" in b_to_a.dead

    def test_a_short_freeze_costs_nothing(self, net: Net) -> None:
        a_to_b, b_to_a = net.a.connect("b"), net.b.connect("a")
        net.net.freeze("b")
        a_to_b.transmit(b"x")
        net.after(HEARTBEAT.timeout / 2)
        net.net.thaw("b")
        net.after(HEARTBEAT.timeout)
        assert a_to_b.alive
        assert b_to_a.alive
        assert frames(net.b) == [b"x"]

    def test_no_bytes_flow_across_a_cut_or_to_a_frozen_node(self, net: Net) -> None:
        assert net.net.carries("a", "b")
        net.net.cut("b", "a")
        assert not net.net.carries("a", "b")
        net.net.heal("b", "a")
        net.net.freeze("b")
        assert not net.net.carries("a", "b")
        net.net.thaw("b")
        assert net.net.carries("a", "b")
