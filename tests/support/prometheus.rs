//! The test binary's one `metrics` recorder: a Prometheus recorder, installed by the first test
//! that asks for it. A process holds one global recorder, and a handle bound while none is
//! installed stays a no-op, so each test that reads metrics builds its layers after calling
//! [`handle`], and reads only the series of policy names no other test uses.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// The handle of the binary's recorder (installed on the first call).
pub fn handle() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::set_global_recorder(recorder).expect("the only recorder of this test binary");
        handle
    })
}
