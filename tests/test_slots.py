"""PrioritySlots: never more than n holders; waiters admitted lowest priority first."""
import threading
import time

from datacache._slots import PrioritySlots


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
    while len(order) < 2:
        time.sleep(0.001)
    waiters = [threading.Thread(target=hold, args=(p, False), name=f"waiter-{p}") for p in (5, 3, 9, 1, 7)]
    for t in waiters:
        t.start()
    while len(slots._waiting) < 5:  # every waiter is queued behind the blockers
        time.sleep(0.001)
    gate.set()
    for t in blockers + waiters:
        t.join(10)
    assert order[2:] == [1, 3, 5, 7, 9]
    assert peak[0] <= 2
