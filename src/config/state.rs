//! The running configuration that a [`LimitsLayer`](super::LimitsLayer), its services and
//! its [`ReloadHandle`](super::ReloadHandle)s share.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;

use super::LimitsConfig;
use super::build::{self, BuiltRule};
use super::error::ConfigFileError;
use crate::limiter::Limiter;
use crate::store::Store;

/// A configuration bound to a store: what a request reads, all at once.
pub(super) struct Snapshot<St: Store> {
    pub(super) config: Arc<LimitsConfig>,
    pub(super) limiters: HashMap<String, Limiter<St>>,
    pub(super) rules: Box<[BuiltRule<St>]>,
}

/// What every clone of the layer, its services and its handles share.
pub(super) struct Shared<St: Store> {
    /// The running configuration. Requests load it without locking; a reload swaps it.
    pub(super) current: ArcSwap<Snapshot<St>>,
    pub(super) store: St,
    /// One reload at a time: each builds on the limiters of the configuration it replaces, so
    /// two at once could bind one policy twice and lose counts.
    pub(super) reloading: Mutex<()>,
}

impl<St: Store> Shared<St> {
    pub(super) fn new(config: LimitsConfig, store: St) -> Result<Self, ConfigFileError> {
        let bound = build::assemble(&config, &store, None)?;
        let snapshot =
            Snapshot { config: Arc::new(config), limiters: bound.limiters, rules: bound.rules };
        Ok(Self { current: ArcSwap::from_pointee(snapshot), store, reloading: Mutex::new(()) })
    }
}
