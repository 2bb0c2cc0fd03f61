//! The command line, and envoyproxy/ratelimit's environment variables.
//!
//! `tollgate-server --config <file or directory> --listen <addr:port> [--redis <url>]` is the
//! one command. Run without `--listen`, the server takes its addresses, configuration
//! directory and Redis from the environment variables of envoyproxy/ratelimit's container
//! (`GRPC_HOST`/`GRPC_PORT`, `HOST`/`PORT` for `/healthcheck`, `RUNTIME_ROOT`,
//! `RUNTIME_SUBDIRECTORY`, `RUNTIME_APPDIRECTORY`, `REDIS_SOCKET_TYPE`, `REDIS_URL`,
//! `REDIS_TYPE`, `REDIS_AUTH`, `USE_PROMETHEUS`, `PROMETHEUS_ADDR`, ...), with its defaults, so
//! it runs where that image runs. A flag wins over its variable.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::config::HeaderStyle;

/// How the Redis servers are reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisKind {
    /// One server (`nodes[0]`).
    Single,
    /// A Redis Cluster: `nodes` are seed nodes.
    Cluster,
    /// Redis Sentinel: `nodes` are the sentinels, `master` the monitored master's name, `node`
    /// how to connect to the servers they name (password, database).
    Sentinel {
        /// The master's name.
        master: String,
        /// A URL whose user, password and database are used for the servers.
        node: Option<String>,
    },
}

/// The Redis to use, as URLs the `redis` crate reads (`redis://host:port`,
/// `redis+unix:///path`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisTarget {
    /// The topology.
    pub kind: RedisKind,
    /// The servers' URLs.
    pub nodes: Vec<String>,
}

/// Everything the server is told.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// A configuration file, or a directory of them.
    pub config: PathBuf,
    /// Companion files kept apart from the reference's files (a file or a directory).
    pub extensions: Option<PathBuf>,
    /// The gRPC address.
    pub listen: SocketAddr,
    /// The HTTP address of `/healthcheck` (and `/metrics` when metrics are on).
    pub http: Option<SocketAddr>,
    /// The Prometheus address, when metrics are on.
    pub metrics: Option<SocketAddr>,
    /// The Prometheus path (default `/metrics`).
    pub metrics_path: String,
    /// Redis, or the memory store when `None`.
    pub redis: Option<RedisTarget>,
    /// Longest wait for Redis per call.
    pub redis_timeout: Duration,
    /// `CACHE_KEY_PREFIX` of the reference's counters.
    pub cache_key_prefix: String,
    /// `EXPIRATION_JITTER_MAX_SECONDS`.
    pub jitter_max: u64,
    /// `NEAR_LIMIT_RATIO`.
    pub near_limit_ratio: f32,
    /// `MERGE_DOMAIN_CONFIG`.
    pub merge_domains: bool,
    /// `SHADOW_MODE`: never refuse.
    pub shadow_mode: bool,
    /// Headers to add to responses.
    pub headers: HeaderStyle,
    /// The names of the legacy headers: limit, remaining, reset.
    pub header_names: [String; 3],
    /// How often the configuration is looked at for changes.
    pub watch: Duration,
    /// The log level (`LOG_LEVEL`).
    pub log_level: tracing::Level,
    /// How long a shutdown waits for clients to close their connections (Envoy keeps its
    /// connections open) before closing them.
    pub grace: Duration,
}

/// A command line or environment the server cannot run with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SettingsError(pub String);

const USAGE: &str = "usage: tollgate-server --config <file or directory> --listen <addr:port> [--redis <url>[,<url>...]]
  [--redis-type single|cluster|sentinel] [--redis-master <name>] [--http <addr:port>]
  [--metrics <addr:port>] [--headers none|legacy|ietf] [--watch <duration>] [--grace <duration>]
  [--extensions <file or directory of *.tollgate.yaml>]";

fn err(s: impl Into<String>) -> SettingsError {
    SettingsError(s.into())
}

fn addr(what: &str, s: &str) -> Result<SocketAddr, SettingsError> {
    // ":9090" (Go's form) listens on every interface.
    let s = if s.starts_with(':') { format!("0.0.0.0{s}") } else { s.to_owned() };
    s.parse().map_err(|_| err(format!("{what}: '{s}' is not an address (addr:port)")))
}

fn flag(what: &str, s: &str) -> Result<bool, SettingsError> {
    match s.to_ascii_lowercase().as_str() {
        "true" | "1" | "t" => Ok(true),
        "false" | "0" | "f" | "" => Ok(false),
        _ => Err(err(format!("{what}: '{s}' is not a boolean"))),
    }
}

/// The URL of one reference-style address: `host:port` over TCP, or a socket path.
fn redis_url(socket: &str, address: &str, auth: &str) -> Result<String, SettingsError> {
    if address.contains("://") {
        return Ok(address.to_owned());
    }
    let auth = match auth.split_once(':') {
        _ if auth.is_empty() => String::new(),
        Some((user, pass)) => format!("{user}:{pass}@"),
        None => format!(":{auth}@"),
    };
    match socket {
        "unix" => {
            let query = match auth.strip_suffix('@') {
                Some(a) if !a.is_empty() => {
                    let (user, pass) = a.split_once(':').unwrap_or(("", a));
                    if user.is_empty() {
                        format!("?pass={pass}")
                    } else {
                        format!("?user={user}&pass={pass}")
                    }
                }
                _ => String::new(),
            };
            Ok(format!("redis+unix://{address}{query}"))
        }
        "tcp" => Ok(format!("redis://{auth}{address}")),
        other => Err(err(format!("REDIS_SOCKET_TYPE: '{other}' (expected tcp or unix)"))),
    }
}

impl Settings {
    /// Reads `args` (without the program's name) and the environment through `env`.
    ///
    /// # Errors
    /// [`SettingsError`] naming the flag or variable.
    pub fn parse(
        args: impl IntoIterator<Item = String>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, SettingsError> {
        let mut flags: std::collections::HashMap<&'static str, String> = Default::default();
        let names = [
            "config",
            "listen",
            "redis",
            "redis-type",
            "redis-master",
            "http",
            "metrics",
            "headers",
            "watch",
            "grace",
            "extensions",
        ];
        let mut args = args.into_iter();
        while let Some(a) = args.next() {
            if a == "--help" || a == "-h" {
                return Err(err(USAGE));
            }
            let Some(body) = a.strip_prefix("--") else {
                return Err(err(format!("unexpected argument '{a}'\n{USAGE}")));
            };
            let (name, value) = match body.split_once('=') {
                Some((n, v)) => (n.to_owned(), Some(v.to_owned())),
                None => (body.to_owned(), None),
            };
            let Some(&known) = names.iter().find(|n| **n == name) else {
                return Err(err(format!("unknown flag '--{name}'\n{USAGE}")));
            };
            let value = match value {
                Some(v) => v,
                None => args.next().ok_or_else(|| err(format!("--{name} needs a value")))?,
            };
            flags.insert(known, value);
        }
        let var = |name: &str| env(name).filter(|v| !v.is_empty());
        let cli = flags.contains_key("listen");

        let config = match flags.remove("config") {
            Some(c) => PathBuf::from(c),
            None => {
                let root =
                    var("RUNTIME_ROOT").unwrap_or_else(|| "/srv/runtime_data/current".into());
                let sub = var("RUNTIME_SUBDIRECTORY").unwrap_or_default();
                let app = var("RUNTIME_APPDIRECTORY").unwrap_or_else(|| "config".into());
                PathBuf::from(root).join(sub).join(app)
            }
        };
        let extensions =
            flags.remove("extensions").or_else(|| var("TOLLGATE_EXTENSIONS")).map(PathBuf::from);
        let listen = match flags.remove("listen") {
            Some(l) => addr("--listen", &l)?,
            None => {
                if var("GRPC_UDS").is_some() {
                    return Err(err(
                        "GRPC_UDS: listening on a Unix socket is not supported; use GRPC_HOST and GRPC_PORT",
                    ));
                }
                let host = var("GRPC_HOST").unwrap_or_else(|| "0.0.0.0".into());
                let port = var("GRPC_PORT").unwrap_or_else(|| "8081".into());
                addr("GRPC_HOST/GRPC_PORT", &format!("{host}:{port}"))?
            }
        };
        let http = match flags.remove("http") {
            Some(h) => Some(addr("--http", &h)?),
            None if cli && var("PORT").is_none() => None,
            None => {
                let host = var("HOST").unwrap_or_else(|| "0.0.0.0".into());
                let port = var("PORT").unwrap_or_else(|| "8080".into());
                Some(addr("HOST/PORT", &format!("{host}:{port}"))?)
            }
        };
        let metrics = match flags.remove("metrics") {
            Some(m) => Some(addr("--metrics", &m)?),
            None if var("USE_PROMETHEUS").map(|v| flag("USE_PROMETHEUS", &v)).transpose()?
                == Some(true) =>
            {
                Some(addr(
                    "PROMETHEUS_ADDR",
                    &var("PROMETHEUS_ADDR").unwrap_or_else(|| ":9090".into()),
                )?)
            }
            None => None,
        };
        let metrics_path = var("PROMETHEUS_PATH").unwrap_or_else(|| "/metrics".into());

        if let Some(b) = var("BACKEND_TYPE")
            && !b.eq_ignore_ascii_case("redis")
        {
            return Err(err(format!(
                "BACKEND_TYPE: '{b}' is not supported (Redis, or memory without REDIS_URL)"
            )));
        }
        if let Some(c) = var("CONFIG_TYPE")
            && !c.eq_ignore_ascii_case("FILE")
        {
            return Err(err(format!("CONFIG_TYPE: '{c}' is not supported (FILE only)")));
        }
        if var("REDIS_TLS").map(|v| flag("REDIS_TLS", &v)).transpose()? == Some(true) {
            return Err(err("REDIS_TLS: TLS to Redis is not built into this server"));
        }
        let redis = {
            let kind = flags
                .remove("redis-type")
                .or_else(|| var("REDIS_TYPE"))
                .unwrap_or_else(|| "single".into())
                .to_ascii_lowercase();
            let auth = var("REDIS_AUTH").unwrap_or_default();
            let (urls, from_env): (Option<Vec<String>>, bool) = match flags.remove("redis") {
                Some(u) => (Some(u.split(',').map(|s| s.trim().to_owned()).collect()), false),
                None => (
                    var("REDIS_URL").map(|u| u.split(',').map(|s| s.trim().to_owned()).collect()),
                    true,
                ),
            };
            match urls {
                None => None,
                Some(mut urls) => {
                    let socket = var("REDIS_SOCKET_TYPE")
                        .unwrap_or_else(|| "unix".into())
                        .to_ascii_lowercase();
                    let to_url = |a: &str, auth: &str| {
                        if from_env { redis_url(&socket, a, auth) } else { redis_url("tcp", a, "") }
                    };
                    let kind = match kind.as_str() {
                        "single" => RedisKind::Single,
                        "cluster" => RedisKind::Cluster,
                        "sentinel" => {
                            let master = match flags.remove("redis-master") {
                                Some(m) => m,
                                // The reference's form: "master,sentinel1:port,sentinel2:port".
                                None if urls.len() > 1 => urls.remove(0),
                                None => {
                                    return Err(err(
                                        "sentinel: name the master (--redis-master, or REDIS_URL=master,host:port,...)",
                                    ));
                                }
                            };
                            let node = if auth.is_empty() {
                                None
                            } else {
                                Some(redis_url("tcp", "localhost", &auth)?)
                            };
                            RedisKind::Sentinel { master, node }
                        }
                        other => {
                            return Err(err(format!(
                                "redis type '{other}' (expected single, cluster or sentinel)"
                            )));
                        }
                    };
                    let node_auth = match kind {
                        RedisKind::Sentinel { .. } => {
                            var("REDIS_SENTINEL_AUTH").unwrap_or_default()
                        }
                        _ => auth.clone(),
                    };
                    let nodes = urls
                        .iter()
                        .map(|u| to_url(u, &node_auth))
                        .collect::<Result<Vec<_>, _>>()?;
                    if kind == RedisKind::Single && nodes.len() != 1 {
                        return Err(err(
                            "a single Redis takes one address (REDIS_TYPE=cluster for several)",
                        ));
                    }
                    Some(RedisTarget { kind, nodes })
                }
            }
        };
        let redis_timeout = match var("REDIS_TIMEOUT") {
            Some(t) => parse_duration("REDIS_TIMEOUT", &t)?,
            None => Duration::from_millis(100),
        };
        let number = |name: &str, default: &str| -> Result<f64, SettingsError> {
            let v = var(name).unwrap_or_else(|| default.into());
            v.parse::<f64>().map_err(|_| err(format!("{name}: '{v}' is not a number")))
        };
        let near_limit_ratio = number("NEAR_LIMIT_RATIO", "0.8")? as f32;
        let jitter = number("EXPIRATION_JITTER_MAX_SECONDS", "300")?;
        let headers = match flags.remove("headers") {
            Some(h) => HeaderStyle::from_name(&h)
                .ok_or_else(|| err(format!("--headers: '{h}' (expected none, legacy or ietf)")))?,
            None if var("LIMIT_RESPONSE_HEADERS_ENABLED")
                .map(|v| flag("LIMIT_RESPONSE_HEADERS_ENABLED", &v))
                .transpose()?
                == Some(true) =>
            {
                HeaderStyle::Legacy
            }
            None => HeaderStyle::None,
        };
        let header_names = [
            var("LIMIT_LIMIT_HEADER").unwrap_or_else(|| "RateLimit-Limit".into()),
            var("LIMIT_REMAINING_HEADER").unwrap_or_else(|| "RateLimit-Remaining".into()),
            var("LIMIT_RESET_HEADER").unwrap_or_else(|| "RateLimit-Reset".into()),
        ];
        let watch = match flags.remove("watch") {
            Some(w) => parse_duration("--watch", &w)?,
            None => Duration::from_secs(1),
        };
        let grace = match flags.remove("grace") {
            Some(g) => parse_duration("--grace", &g)?,
            None => Duration::from_secs(10),
        };
        let log_level = match var("LOG_LEVEL").map(|l| l.to_ascii_lowercase()).as_deref() {
            None | Some("info") => tracing::Level::INFO,
            Some("warn" | "warning") => tracing::Level::WARN,
            Some("error" | "fatal" | "panic") => tracing::Level::ERROR,
            Some("debug") => tracing::Level::DEBUG,
            Some("trace") => tracing::Level::TRACE,
            Some(other) => return Err(err(format!("LOG_LEVEL: '{other}'"))),
        };
        Ok(Self {
            config,
            extensions,
            listen,
            http,
            metrics,
            metrics_path,
            redis,
            redis_timeout,
            cache_key_prefix: var("CACHE_KEY_PREFIX").unwrap_or_default(),
            jitter_max: jitter.max(0.0) as u64,
            near_limit_ratio,
            merge_domains: var("MERGE_DOMAIN_CONFIG")
                .map(|v| flag("MERGE_DOMAIN_CONFIG", &v))
                .transpose()?
                .unwrap_or(false),
            shadow_mode: var("SHADOW_MODE")
                .map(|v| flag("SHADOW_MODE", &v))
                .transpose()?
                .unwrap_or(false),
            headers,
            header_names,
            watch,
            log_level,
            grace,
        })
    }

    /// Says once in the log which of the reference's variables this server reads but does not
    /// act on, so that none is ignored silently.
    pub fn warn_unsupported(env: impl Fn(&str) -> Option<String>) {
        let notes = [
            ("USE_STATSD", "statsd is not sent; metrics are served to Prometheus (USE_PROMETHEUS)"),
            (
                "USE_DOG_STATSD",
                "DogStatsD is not sent; metrics are served to Prometheus (USE_PROMETHEUS)",
            ),
            (
                "LOCAL_CACHE_SIZE_IN_BYTES",
                "no local cache of over-limit keys for fixed windows (extension policies on Redis keep refusals locally)",
            ),
            (
                "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT",
                "a refused request is never counted, whatever this says",
            ),
            ("REDIS_PERSECOND", "per-second limits share the one Redis"),
            ("RESPONSE_DYNAMIC_METADATA", "no dynamic metadata is sent"),
            ("QUOTA_MODE", "the global quota mode is not supported (quota_mode per descriptor is)"),
            ("GRPC_MAX_CONNECTION_AGE", "connections are not aged out"),
            ("TRACING_ENABLED", "no OpenTelemetry traces are sent"),
            ("GRPC_SERVER_USE_TLS", "the gRPC port serves plain text; put TLS in front"),
            ("DEBUG_PORT", "there is no debug port"),
        ];
        for (name, why) in notes {
            if env(name).is_some_and(|v| !v.is_empty() && v != "false" && v != "0") {
                tracing::warn!("tollgate-server: {name} is set but not supported: {why}");
            }
        }
    }
}

fn parse_duration(what: &str, s: &str) -> Result<Duration, SettingsError> {
    humantime::parse_duration(s).map_err(|e| err(format!("{what}: '{s}': {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str], env: &[(&str, &str)]) -> Result<Settings, SettingsError> {
        let env: Vec<(String, String)> =
            env.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect();
        Settings::parse(args.iter().map(|s| (*s).to_owned()), |k| {
            env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
        })
    }

    #[test]
    fn the_one_command() {
        let s = parse(
            &[
                "--config",
                "limits.yaml",
                "--listen",
                "127.0.0.1:8081",
                "--redis",
                "redis://127.0.0.1:6380",
            ],
            &[],
        )
        .unwrap();
        assert_eq!(s.config, PathBuf::from("limits.yaml"));
        assert_eq!(s.listen, "127.0.0.1:8081".parse().unwrap());
        assert_eq!(s.http, None);
        assert_eq!(
            s.redis,
            Some(RedisTarget {
                kind: RedisKind::Single,
                nodes: vec!["redis://127.0.0.1:6380".into()]
            })
        );
        assert_eq!(parse(&["--config=x", "--listen=127.0.0.1:1"], &[]).unwrap().redis, None);
    }

    #[test]
    fn the_reference_containers_environment() {
        let s = parse(
            &[],
            &[
                ("RUNTIME_ROOT", "/data"),
                ("RUNTIME_SUBDIRECTORY", "ratelimit"),
                ("REDIS_SOCKET_TYPE", "tcp"),
                ("REDIS_URL", "redis.default:6379"),
                ("REDIS_AUTH", "secret"),
                ("USE_PROMETHEUS", "true"),
            ],
        )
        .unwrap();
        assert_eq!(s.config, PathBuf::from("/data/ratelimit/config"));
        assert_eq!(s.listen, "0.0.0.0:8081".parse().unwrap());
        assert_eq!(s.http, Some("0.0.0.0:8080".parse().unwrap()));
        assert_eq!(s.metrics, Some("0.0.0.0:9090".parse().unwrap()));
        assert_eq!(s.redis.unwrap().nodes, vec!["redis://:secret@redis.default:6379".to_owned()]);
        let s = parse(
            &[],
            &[
                ("REDIS_URL", "mymaster,s1:26379,s2:26379"),
                ("REDIS_TYPE", "SENTINEL"),
                ("REDIS_SOCKET_TYPE", "tcp"),
            ],
        )
        .unwrap();
        assert_eq!(
            s.redis,
            Some(RedisTarget {
                kind: RedisKind::Sentinel { master: "mymaster".into(), node: None },
                nodes: vec!["redis://s1:26379".into(), "redis://s2:26379".into()],
            })
        );
        let s = parse(&[], &[("REDIS_URL", "/var/run/r.sock")]).unwrap();
        assert_eq!(s.redis.unwrap().nodes, vec!["redis+unix:///var/run/r.sock".to_owned()]);
    }

    #[test]
    fn refusals_name_the_flag_or_variable() {
        assert!(parse(&["--listen", "nowhere"], &[]).unwrap_err().0.starts_with("--listen"));
        assert!(parse(&["--bogus", "1"], &[]).unwrap_err().0.starts_with("unknown flag '--bogus'"));
        assert!(
            parse(&[], &[("BACKEND_TYPE", "memcache")]).unwrap_err().0.starts_with("BACKEND_TYPE")
        );
        assert!(parse(&[], &[("REDIS_TLS", "true")]).unwrap_err().0.starts_with("REDIS_TLS"));
        assert!(parse(&["--headers", "x"], &[]).unwrap_err().0.starts_with("--headers"));
    }
}
