"""PrioritySlots: never more than n holders; waiters admitted lowest priority first."""
import threading

from datacache.store.transfer import PrioritySlots
from tests.helpers.faults import wait_for


def test_priority_order_and_bound() -> None:
    slots = PrioritySlots(2)
    order: list[int] = []
    inside = [0]
    peak = [0]
    lock = threading.Lock()
    gate = threading.Event()

    def hold(p: int, wait_gate: bool) -> None:
        with slots.hold(p):
            with lock:
                inside[0] += 1
                peak[0] = max(peak[0], inside[0])
                order.append(p)
            if wait_gate:
                gate.wait(10)
            with lock:
                inside[0] -= 1

    blockers = [threading.Thread(target=hold, args=(-1, True), name=f"blocker-{i}") for i in range(2)]
    for t in blockers:
        t.start()
    wait_for(lambda: len(order) >= 2, 30, "both blockers inside")
    waiters = [threading.Thread(target=hold, args=(p, False), name=f"waiter-{p}") for p in (5, 3, 9, 1, 7)]
    for t in waiters:
        t.start()
    wait_for(lambda: len(slots._waiting) >= 5, 30, "every waiter queued behind the blockers")
    gate.set()
    for t in blockers + waiters:
        t.join(10)
    assert order[2:] == [1, 3, 5, 7, 9]
    assert peak[0] <= 2
