//! Metrics and access logs.
//!
//! - [`metrics`]: Prometheus metrics with Istio's names and labels (so
//!   existing dashboards work) plus ztunnel's own.
//! - [`connection`]: one record per proxied connection: counts it as opened,
//!   then on close adds bytes, counts it as closed and writes the access log
//!   line (tracing target `access`).
//! - [`throttle`]: at most one line per interval for warnings that come in
//!   floods (limits reached, accept errors).
//! - [`log_filter`]: checks and completes a log filter before it replaces
//!   the running one (`--log`, the admin `/logging` endpoint).

pub mod connection;
pub mod log_filter;
pub mod metrics;
pub mod throttle;

pub use connection::{ConnectionRecord, Endpoint, ServiceRef, WorkloadMeta};
pub use metrics::Metrics;
