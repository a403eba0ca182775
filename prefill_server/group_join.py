"""A process-group pairing's join (nccl/gloo) on a thread of its own: the part of PrefillPairing that waits.

Why apart from pairing.py: the handshake answers at once and the join runs after it, on threads of their own, with
its own failure modes (a decode worker that dies mid-join, a newer handshake, the stop) and its own way of giving up;
pairing.py keeps the handshake, the grpc/cuda_ipc (re)connect, the requests and the health. The methods here run on
the device thread (_rejoin, _joined) or the join's thread (_join); PrefillPairing holds the state they use (config,
worker, gpu, pairs, health, stopping) and the steps they share (_drop, _forget, _paired, _settle, _on_failure).
"""

from __future__ import annotations

import logging
import threading

from kvtransfer.transport import TransferError
from prefill_server.pair import Pair

log = logging.getLogger("kvtransfer.prefill")


class GroupJoin:
    """Mixed into PrefillPairing: the process-group join of one pairing (pair, epoch)."""

    def _rejoin(self, pair: Pair, epoch: int, gone: list[Pair]) -> None:
        """Device thread: the pair's old group dropped (no transfer of it is in progress here), then the new group
        joined on a thread of the join's own (_join)."""
        self._forget(gone)
        if epoch != pair.epoch:
            log.info("pairing epoch %d superseded by %d before it started", epoch, pair.epoch)
            return  # the newer epoch settles it
        self._drop(pair)
        threading.Thread(target=self._join, args=(pair, epoch), name=f"pair-join-{epoch}", daemon=True).start()

    def _abandoned(self, pair: Pair, epoch: int) -> str:
        """Why a join of `pair`'s `epoch` is no longer wanted ("" while it is)."""
        if self.stopping:
            return "stopping"
        if epoch != pair.epoch:
            return f"superseded by epoch {pair.epoch}"
        if self.pairs.get(pair.instance) is not pair or (self.health is not None and self.health.left(pair.instance)):
            return "the decode worker is gone: its liveness watch closed"
        return ""

    def _join(self, pair: Pair, epoch: int) -> None:
        """Join the pairing's group, on a thread of its own. Why not on the device thread: a decode worker that dies
        mid-join can leave torch's group constructor waiting on its connection for about 50 s whatever the
        timeouts say, and nothing interrupts it; on the device thread that held every later pairing (and every
        prefill). Over a store connection of its own for the same reason (a store wait holds its connection). The
        join gives way as soon as it is abandoned (superseded, stopping, or its decode worker gone); one that ends
        in torch after that is left (_joined)."""
        from kvtransfer.transport.rendezvous import PairingAbandoned, join_pair, open_store, pairing_prefix, \
            store_address
        c, device = self.config, self.worker.m.device
        log.info("joining process group epoch %d as rank 0 (%s)", epoch, self.transport)
        try:
            if device.type == "cuda":  # as on the device thread: NCCL's communicator is made on this device
                import torch
                torch.cuda.set_device(device)
            store = open_store(c.dist_init, 1, c.dist_timeout_s)  # rank 1: connect to it, do not host it
            group = join_pair(0, store, pairing_prefix(self.instance_id, epoch), device, c.dist_timeout_s,
                              c.dist_op_timeout_s, lambda: bool(self._abandoned(pair, epoch)),
                              store_address(c.dist_init)[0])
        except PairingAbandoned:
            log.info("pairing epoch %d abandoned before the decode peer joined (%s)", epoch,
                     self._abandoned(pair, epoch) or "?")
            self._from_thread(self._settle(pair, epoch))
            return
        except Exception as e:  # noqa: BLE001 - torch reports a failed rendezvous as RuntimeError; logged, never lost
            why = self._abandoned(pair, epoch)
            log.log(logging.INFO if why else logging.ERROR, "pairing epoch %d failed: %s; %s", epoch,
                    str(e).splitlines()[0] if str(e) else repr(e),
                    f"it was abandoned meanwhile ({why})" if why else "waiting for the decode peer to handshake again")
            self._from_thread(self._settle(pair, epoch))
            return
        try:
            self.gpu.submit(self._joined, pair, epoch, group).add_done_callback(self._on_failure(pair, epoch))
        except RuntimeError:  # the device thread was shut down: the server stopped
            from kvtransfer.transport.rendezvous import leave_pair
            leave_pair(group)
            self._from_thread(self._settle(pair, epoch))

    def _joined(self, pair: Pair, epoch: int, group) -> None:
        """Device thread: a joined group becomes the pair's link, warmed up, unless the join was abandoned meanwhile."""
        from kvtransfer.transport.rendezvous import leave_pair
        if why := self._abandoned(pair, epoch):
            log.info("pairing epoch %d joined after it was abandoned (%s); its group left", epoch, why)
            leave_pair(group)
            self._from_thread(self._settle(pair, epoch))
            return
        pair.group = group
        try:
            pair.link = self.connect(group=group)
            self.worker.warmup(self.config.warmup_tokens, pair.link)
        except (TransferError, RuntimeError) as e:
            log.error("pairing epoch %d failed: %s; waiting for the decode peer to handshake again", epoch, e)
            self._drop(pair)
            self._from_thread(self._settle(pair, epoch))
            return
        self._paired(pair, epoch)
