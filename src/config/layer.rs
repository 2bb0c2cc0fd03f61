//! [`LimitsLayer`] and its [`ReloadHandle`].

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, Weak};
use std::time::Duration;

use tower_layer::Layer;

use super::LimitsConfig;
use super::build;
use super::error::ConfigFileError;
use super::service::Limits;
use super::state::{Shared, Snapshot};
use crate::limiter::Limiter;
use crate::store::{MemoryStore, Store};

/// A Tower layer that limits requests as a [`LimitsConfig`] says, and whose configuration can
/// be replaced while it serves ([`handle`](Self::handle)).
///
/// Each request goes through the rate-limit layers of the rules that match it (see the
/// [module docs](super)); one that matches no rule reaches the inner service untouched.
///
/// ```
/// use http::{Request, StatusCode};
/// use http_body_util::Full;
/// use bytes::Bytes;
/// use tollgate::RequestBody;
/// use tollgate::config::{LimitsConfig, LimitsLayer};
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let config = LimitsConfig::from_toml(
///     r#"
///     [policies.api]
///     tiers = [{ name = "api", count = 1, period = "1m" }]
///     [[rules]]
///     name = "api"
///     paths = ["/api/*"]
///     key = "global"
///     policy = "api"
///     "#,
///     "inline.toml",
/// )
/// .unwrap();
/// let svc = LimitsLayer::new(config).unwrap().layer(service_fn(|_req: Request<RequestBody<Full<Bytes>>>| async {
///     Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from("hi"))))
/// }));
/// let get = |path: &str| Request::get(path).body(Full::default()).unwrap();
/// assert_eq!(svc.clone().oneshot(get("/api/a")).await.unwrap().status(), StatusCode::OK);
/// assert_eq!(svc.clone().oneshot(get("/api/a")).await.unwrap().status(), StatusCode::TOO_MANY_REQUESTS);
/// // No rule matches: untouched.
/// assert_eq!(svc.oneshot(get("/health")).await.unwrap().status(), StatusCode::OK);
/// # }
/// ```
pub struct LimitsLayer<St: Store = MemoryStore> {
    shared: Arc<Shared<St>>,
}

impl<St: Store> Clone for LimitsLayer<St> {
    fn clone(&self) -> Self {
        Self { shared: Arc::clone(&self.shared) }
    }
}

impl<St: Store> fmt::Debug for LimitsLayer<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let current = self.shared.current.load();
        f.debug_struct("LimitsLayer").field("config", &current.config).finish_non_exhaustive()
    }
}

impl LimitsLayer {
    /// Serves `config` with its state in a new [`MemoryStore`].
    ///
    /// # Errors
    /// None in practice: a [`LimitsConfig`] was checked against a memory store when it was
    /// read. The `Result` is [`with_store`](Self::with_store)'s.
    pub fn new(config: LimitsConfig) -> Result<Self, ConfigFileError> {
        Self::with_store(config, MemoryStore::new())
    }
}

impl<St: Store> LimitsLayer<St> {
    /// Serves `config` with its state in `store` (a [`MemoryStore`] with another clock, a
    /// `RedisStore`, ...). Every policy is bound to it once, here.
    ///
    /// # Errors
    /// [`ConfigFileError`] at the policy's tier when the store refuses it
    /// ([`Store::bind`]).
    pub fn with_store(config: LimitsConfig, store: St) -> Result<Self, ConfigFileError> {
        Ok(Self { shared: Arc::new(Shared::new(config, store)?) })
    }

    /// A handle that replaces the layer's configuration (and that of every clone of it and of
    /// its services).
    #[must_use]
    pub fn handle(&self) -> ReloadHandle<St> {
        ReloadHandle { shared: Arc::clone(&self.shared) }
    }
}

impl<S, St: Store> Layer<S> for LimitsLayer<St> {
    type Service = Limits<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        Limits::new(inner, Arc::clone(&self.shared))
    }
}

/// Replaces the configuration of a [`LimitsLayer`] while it serves, and gives the running
/// policies' limiters. Made by [`LimitsLayer::handle`], and cheap to clone.
///
/// ```
/// use tollgate::config::{LimitsConfig, LimitsLayer};
/// use tollgate::key::Key;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let v1 = "[policies.api]\ntiers = [{ name = \"api\", count = 10, period = \"1m\" }]\n";
/// let layer = LimitsLayer::new(LimitsConfig::from_toml(v1, "v1.toml").unwrap()).unwrap();
/// let handle = layer.handle();
/// handle.limiter("api").unwrap().check(&Key::text("k"), 4).await.unwrap();
/// let v2 = v1.replace("count = 10", "count = 20");
/// handle.reload(LimitsConfig::from_toml(&v2, "v2.toml").unwrap()).unwrap();
/// let now = handle.limiter("api").unwrap().check(&Key::text("k"), 0).await.unwrap();
/// assert_eq!(now.tiers()[0].remaining(), 20); // a changed tier starts full (by default)
/// # }
/// ```
///
/// A reload builds the new configuration beside the running one and swaps it in atomically:
/// requests already in progress finish under the configuration they started with, new ones
/// use the new one, and none waits or fails. A policy whose definition did not change keeps its
/// state; a changed one keeps its penalty blocks, its slots held and the state of its
/// unchanged tiers (see [`Reloaded`] and the [module docs](super#reloading)).
pub struct ReloadHandle<St: Store = MemoryStore> {
    shared: Arc<Shared<St>>,
}

impl<St: Store> Clone for ReloadHandle<St> {
    fn clone(&self) -> Self {
        Self { shared: Arc::clone(&self.shared) }
    }
}

impl<St: Store> fmt::Debug for ReloadHandle<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReloadHandle").field("config", &self.config()).finish_non_exhaustive()
    }
}

impl<St: Store> ReloadHandle<St> {
    /// Replaces the running configuration with `config`.
    ///
    /// A key blocked by a penalty box stays blocked until its block ends, and requests in
    /// flight keep their concurrency slots, counted against the new configuration's `max`
    /// (see the [module docs](super#reloading)). On a [`MemoryStore`] no charge is lost to the
    /// reload: requests still in progress under the replaced configuration charge a changed
    /// policy's unchanged tiers where the new configuration counts them, so such a tier admits
    /// exactly its quota however many reloads happen while requests are in flight (see
    /// [`MemoryStore::rebind_policy`]).
    ///
    /// ```
    /// use tollgate::config::{LimitsConfig, LimitsLayer};
    ///
    /// let file = |count: u32| format!(
    ///     "[policies.a]\ntiers = [{{ name = \"a\", count = {count}, period = \"1h\" }}]\n\
    ///      [policies.b]\ntiers = [{{ name = \"b\", count = 5, period = \"1h\" }}]\n"
    /// );
    /// let layer = LimitsLayer::new(LimitsConfig::from_toml(&file(10), "v1.toml").unwrap()).unwrap();
    /// let handle = layer.handle();
    /// let report = handle.reload(LimitsConfig::from_toml(&file(20), "v2.toml").unwrap()).unwrap();
    /// assert_eq!(report.changed(), ["a"]);
    /// assert_eq!(report.kept(), ["b"]);
    /// assert_eq!(handle.config().file(), "v2.toml");
    /// ```
    ///
    /// # Errors
    /// [`ConfigFileError`] at the policy's tier when the store refuses a new or changed policy
    /// ([`Store::bind`]); without a location when `config` defines no policy, or none of the
    /// running ones, and does not say `replace_all = true`
    /// ([`LimitsConfig::replaces_all`]). The running configuration then stays.
    pub fn reload(&self, config: LimitsConfig) -> Result<Reloaded, ConfigFileError> {
        let _one = self.shared.reloading.lock().unwrap_or_else(PoisonError::into_inner);
        let running = self.shared.current.load_full();
        if !config.replaces_all() && !running.limiters.is_empty() {
            let kept = config.policies().any(|p| running.limiters.contains_key(p.name()));
            if !kept {
                let message = if config.policies().len() == 0 {
                    "defines no policy, which would lift every running limit (a file caught \
                     mid-rewrite reads so); write `replace_all = true` to run without limits"
                } else {
                    "keeps none of the running policies, which would start every key's quota \
                     afresh; write `replace_all = true` to replace them all"
                };
                return Err(ConfigFileError::unlocated(config.file(), message, None));
            }
        }
        let bound = build::assemble(&config, &self.shared.store, Some(&running.limiters))?;
        let report = Reloaded::between(&running.limiters, &config);
        let snapshot =
            Snapshot { config: Arc::new(config), limiters: bound.limiters, rules: bound.rules };
        self.shared.current.store(Arc::new(snapshot));
        Ok(report)
    }

    /// Reads the file at `path` ([`LimitsConfig::load`]) and [reloads](Self::reload) it.
    ///
    /// # Errors
    /// As [`LimitsConfig::load`] and [`reload`](Self::reload); the running configuration then
    /// stays.
    pub fn reload_from(&self, path: impl AsRef<Path>) -> Result<Reloaded, ConfigFileError> {
        self.reload(LimitsConfig::load(path)?)
    }

    /// The running configuration.
    #[must_use]
    pub fn config(&self) -> Arc<LimitsConfig> {
        Arc::clone(&self.shared.current.load().config)
    }

    /// The running limiter of the policy named `name` (the one its rules decide through), for
    /// code that limits something other than requests, or to look at a key's state.
    #[must_use]
    pub fn limiter(&self, name: &str) -> Option<Limiter<St>> {
        self.shared.current.load().limiters.get(name).cloned()
    }

    /// Watches the file at `path` and [reloads](Self::reload) it whenever its content changes,
    /// checking every `every` (at least 1 ms). A file being written, or refused, leaves the
    /// running configuration in place, and each reload or refusal is logged. The future runs
    /// until every layer, service and handle of this configuration is dropped, so spawn it,
    /// and abort its task to stop watching sooner.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # use tollgate::config::{LimitsConfig, LimitsLayer};
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let layer = LimitsLayer::new(LimitsConfig::load("tollgate.toml")?)?;
    /// let watcher = tokio::spawn(layer.handle().watch("tollgate.toml", Duration::from_secs(2)));
    /// // ...
    /// watcher.abort();
    /// # Ok(()) }
    /// ```
    ///
    /// # How it works
    ///
    /// Every `every` (a shorter period than 1 ms is taken as 1 ms) it reads the file, and when
    /// its content differs from what was last read, and a second read a moment later (a
    /// quarter of `every`, between 1 ms and 250 ms) gives the same bytes, it reloads it. A file
    /// still being written is read again on the next tick; a file that defines no policy, or
    /// none of the running ones, is refused unless it says `replace_all = true` (so a file
    /// truncated mid-rewrite never lifts the limits, and its keys keep their state when the
    /// complete file follows). Logs (`tracing`) each reload at `info` (with the kept, changed,
    /// added and removed policies) and each refused file at `error` with the
    /// [`ConfigFileError`] (`file:line:column: field: message`); a refused file keeps the
    /// running configuration. A file that cannot be read (being replaced, say) is logged at
    /// `warn` once and tried again on the next tick.
    ///
    /// The content is compared, not only the modification time, whose granularity is too
    /// coarse on some file systems to tell two writes apart. When the running configuration
    /// was [loaded](LimitsConfig::load) from `path`, its text is what was last read.
    pub async fn watch(self, path: impl Into<PathBuf>, every: Duration) {
        let path = path.into();
        let running = self.config();
        let mut last: Option<Arc<str>> =
            (running.path() == Some(path.as_path())).then(|| running.text.clone());
        drop(running);
        // Weak, so that watching does not keep a configuration nobody serves alive.
        let shared: Weak<Shared<St>> = Arc::downgrade(&self.shared);
        drop(self);
        let mut unreadable: Option<std::io::ErrorKind> = None;
        let every = every.max(Duration::from_millis(1));
        let settle = (every / 4).clamp(Duration::from_millis(1), Duration::from_millis(250));
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(shared) = shared.upgrade() else { return };
            let handle = Self { shared };
            let bytes = match tokio::fs::read(&path).await {
                Ok(bytes) => bytes,
                Err(error) => {
                    if unreadable != Some(error.kind()) {
                        tracing::warn!(
                            file = %path.display(),
                            %error,
                            "tollgate: cannot read the limits file; the running configuration stays"
                        );
                        unreadable = Some(error.kind());
                    }
                    continue;
                }
            };
            unreadable = None;
            if last.as_deref().is_some_and(|t| t.as_bytes() == bytes.as_slice()) {
                continue;
            }
            // A file being written reads differently from one moment to the next: apply what
            // was read only when a second read, a moment later, agrees with it.
            tokio::time::sleep(settle).await;
            if tokio::fs::read(&path).await.ok().as_ref() != Some(&bytes) {
                tracing::debug!(
                    file = %path.display(),
                    "tollgate: the limits file is being written; read again on the next tick"
                );
                continue;
            }
            let text: Arc<str> = String::from_utf8_lossy(&bytes).into();
            let file = path.display().to_string();
            let loaded = LimitsConfig::from_bytes(bytes, file, Some(path.clone()));
            last = Some(text);
            match loaded.and_then(|config| handle.reload(config)) {
                Ok(report) => tracing::info!(
                    file = %path.display(),
                    kept = ?report.kept(),
                    changed = ?report.changed(),
                    added = ?report.added(),
                    removed = ?report.removed(),
                    "tollgate: limits reloaded"
                ),
                Err(error) => tracing::error!(
                    %error,
                    "tollgate: limits file refused; the running configuration stays"
                ),
            }
        }
    }
}

/// What a [reload](ReloadHandle::reload) did to each policy, by name (sorted).
///
/// ```
/// use tollgate::config::{LimitsConfig, LimitsLayer};
///
/// let v1 = "[policies.api]\ntiers = [{ name = \"api\", count = 10, period = \"1m\" }]\n\
///           [policies.login]\ntiers = [{ name = \"login\", count = 5, period = \"1m\" }]\n";
/// let layer = LimitsLayer::new(LimitsConfig::from_toml(v1, "v1.toml").unwrap()).unwrap();
/// let v2 = v1.replace("count = 10", "count = 20");
/// let reloaded = layer.handle().reload(LimitsConfig::from_toml(&v2, "v2.toml").unwrap()).unwrap();
/// assert_eq!(reloaded.changed(), ["api"]);
/// assert_eq!(reloaded.kept(), ["login"]);
/// assert!(reloaded.added().is_empty() && reloaded.removed().is_empty());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Reloaded {
    kept: Vec<String>,
    changed: Vec<String>,
    added: Vec<String>,
    removed: Vec<String>,
}

impl Reloaded {
    fn between<St: Store>(running: &HashMap<String, Limiter<St>>, new: &LimitsConfig) -> Self {
        let mut report = Self::default();
        for policy in new.policies() {
            let name = policy.name().to_owned();
            match running.get(policy.name()) {
                Some(old) if old.policy() == policy => report.kept.push(name),
                Some(_) => report.changed.push(name),
                None => report.added.push(name),
            }
        }
        report.removed =
            running.keys().filter(|name| new.policy(name).is_none()).cloned().collect();
        for list in [&mut report.kept, &mut report.changed, &mut report.added, &mut report.removed]
        {
            list.sort_unstable();
        }
        report
    }

    /// Policies whose definition did not change: they keep their limiter and every key's state.
    #[must_use]
    pub fn kept(&self) -> &[String] {
        &self.kept
    }

    /// Policies whose algorithm or tiers changed, which are bound anew with their keys' state
    /// carried over as the [module docs](super#reloading) list it per kind of tier.
    ///
    /// Their keys keep their penalty blocks and breaches, and their slots held (requests in
    /// flight count against the new `max`); a rate or calendar tier that did not change keeps
    /// its state (on Redis: when no rate or calendar tier changed), including what requests
    /// still in progress under the old configuration charge it; a changed one starts as the
    /// policy's `changed_tiers` says (full by default).
    #[must_use]
    pub fn changed(&self) -> &[String] {
        &self.changed
    }

    /// Policies the running configuration did not have.
    #[must_use]
    pub fn added(&self) -> &[String] {
        &self.added
    }

    /// Policies the new configuration does not have: their state stays in the store until it
    /// is idle, and a policy that comes back unchanged finds it again.
    #[must_use]
    pub fn removed(&self) -> &[String] {
        &self.removed
    }
}
