//! How long this worker may still act on a lease it holds, as the shard's work sees it.
//!
//! The lease task gives a lease up the moment its hold runs out ([`LeaseSettings::hold_until`]:
//! from the send of the last renewal that landed and the last beat), and the work stops when
//! that cancels its token. On a starved or frozen process that timer fires late, and the work
//! would hand out records after another worker may have taken the lease (issue 57, defect 5). So
//! the work also asks the hold itself before each call of the handler: [`Hold::held`].

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::manager::LeaseSettings;

/// Moves `sender`'s instant up to `sent` (a renewal or a beat that landed); an older send that
/// lands late moves nothing and wakes no watcher.
pub(super) fn landed(sender: &watch::Sender<Instant>, sent: Instant) {
    sender.send_if_modified(|last| {
        let later = sent > *last;
        *last = (*last).max(sent);
        later
    });
}

/// The hold of one lease: the send time of its last renewal that landed and the worker's last
/// beat, as the lease task records them, and the token it cancels when it gives the lease up.
#[derive(Debug, Clone)]
pub struct Hold {
    renewed: watch::Receiver<Instant>,
    beat: watch::Receiver<Instant>,
    settings: LeaseSettings,
    cancel: CancellationToken,
}

impl Hold {
    pub(crate) fn new(
        renewed: watch::Receiver<Instant>,
        beat: watch::Receiver<Instant>,
        settings: LeaseSettings,
        cancel: CancellationToken,
    ) -> Self {
        Self {
            renewed,
            beat,
            settings,
            cancel,
        }
    }

    /// The instant the lease is held until, unless a renewal or a beat lands first.
    pub fn until(&self) -> Instant {
        self.settings
            .hold_until(*self.renewed.borrow(), *self.beat.borrow())
    }

    /// Whether the lease is held now: not given up, and its hold not run out.
    pub fn holds(&self) -> bool {
        !self.cancel.is_cancelled() && Instant::now() < self.until()
    }

    /// Waits until the lease is held now: at once while it is, else until a renewal or beat that
    /// lands moves the hold past now (an answer that came late still proves the lease held from
    /// its send), and `false` once the lease is given up. Nothing may be handed out on `false`.
    pub async fn held(&mut self) -> bool {
        loop {
            if self.cancel.is_cancelled() {
                return false;
            }
            if Instant::now() < self.until() {
                return true;
            }
            tokio::select! {
                biased;
                _ = self.cancel.cancelled() => return false,
                // The lease or the manager gone: nothing proves the lease held any more.
                changed = self.renewed.changed() => {
                    if changed.is_err() {
                        return false;
                    }
                }
                changed = self.beat.changed() => {
                    if changed.is_err() {
                        return false;
                    }
                }
            }
        }
    }
}
