//! Mesh metrics, in derper's naming style, registered on the relay's registry.
//!
//! Packets handed to the mesh and received from it are the relay's own
//! `derp_packets_forwarded_out` and `derp_packets_forwarded_in`; these add the per-sibling
//! view. Queue depths and link states are read when Prometheus scrapes, so the forwarding
//! path never touches a gauge.

use std::sync::Arc;

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

/// Why the mesh dropped a packet instead of forwarding it; the `reason` label of
/// `derp_mesh_forward_drops`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForwardDrop {
    /// The sibling's queue was full: the link cannot keep up.
    QueueFull = 0,
    /// The link to the sibling was down (reconnecting).
    LinkDown = 1,
    /// Writing the packet to the sibling failed; the link was then reconnected.
    WriteError = 2,
}

impl ForwardDrop {
    /// Every reason, in index order.
    pub const ALL: [Self; 3] = [Self::QueueFull, Self::LinkDown, Self::WriteError];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::QueueFull => "queue_full",
            Self::LinkDown => "link_down",
            Self::WriteError => "write_error",
        }
    }
}

/// The labelled families; each link resolves its own children once.
#[derive(Clone, Debug)]
pub(crate) struct MeshMetrics {
    reconnects: IntCounterVec,
    drops: IntCounterVec,
    forwarded: IntCounterVec,
}

/// One link's counters, resolved from the families.
#[derive(Clone, Debug)]
pub(crate) struct LinkMetrics {
    pub(crate) reconnects: IntCounter,
    pub(crate) drops: [IntCounter; 3],
    pub(crate) forwarded: IntCounter,
}

impl MeshMetrics {
    pub(crate) fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let reconnects = IntCounterVec::new(
            Opts::new(
                "derp_mesh_reconnects",
                "connection attempts to a mesh sibling after the first",
            ),
            &["sibling"],
        )?;
        let drops = IntCounterVec::new(
            Opts::new(
                "derp_mesh_forward_drops",
                "packets for a mesh sibling dropped instead of forwarded, by reason",
            ),
            &["sibling", "reason"],
        )?;
        let forwarded = IntCounterVec::new(
            Opts::new(
                "derp_mesh_forwarded_out",
                "packets written to a mesh sibling as ForwardPacket",
            ),
            &["sibling"],
        )?;
        registry.register(Box::new(reconnects.clone()))?;
        registry.register(Box::new(drops.clone()))?;
        registry.register(Box::new(forwarded.clone()))?;
        Ok(Self {
            reconnects,
            drops,
            forwarded,
        })
    }

    /// The children for one sibling, created at zero so dashboards see every series.
    pub(crate) fn link(&self, sibling: &str) -> LinkMetrics {
        LinkMetrics {
            reconnects: self.reconnects.with_label_values(&[sibling]),
            drops: ForwardDrop::ALL.map(|r| self.drops.with_label_values(&[sibling, r.as_str()])),
            forwarded: self.forwarded.with_label_values(&[sibling]),
        }
    }
}

/// A link's state as the gauges show it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LinkState {
    pub(crate) up: bool,
    pub(crate) is_self: bool,
    pub(crate) depth: usize,
}

/// What the scrape-time gauges read from a link.
pub(crate) trait LinkGauges: Send + Sync + std::fmt::Debug {
    fn label(&self) -> &str;
    fn snapshot(&self) -> LinkState;
}

/// `derp_mesh_links_up`, `derp_mesh_siblings` and `derp_mesh_queue_depth{sibling}`,
/// computed at scrape time.
#[derive(Debug)]
pub(crate) struct LinkStateCollector {
    links: Vec<Arc<dyn LinkGauges>>,
    up: IntGauge,
    siblings: IntGauge,
    depth: IntGaugeVec,
}

impl LinkStateCollector {
    pub(crate) fn new(links: Vec<Arc<dyn LinkGauges>>) -> Result<Self, prometheus::Error> {
        let depth = IntGaugeVec::new(
            Opts::new(
                "derp_mesh_queue_depth",
                "packets waiting to be written to a mesh sibling",
            ),
            &["sibling"],
        )?;
        for link in &links {
            depth.with_label_values(&[link.label()]);
        }
        Ok(Self {
            links,
            up: IntGauge::new("derp_mesh_links_up", "mesh links to siblings that are up")?,
            siblings: IntGauge::new(
                "derp_mesh_siblings",
                "configured mesh siblings, not counting entries that name this node itself",
            )?,
            depth,
        })
    }
}

impl Collector for LinkStateCollector {
    fn desc(&self) -> Vec<&Desc> {
        let mut d = self.up.desc();
        d.extend(self.siblings.desc());
        d.extend(self.depth.desc());
        d
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let (mut up, mut siblings) = (0, 0);
        for link in &self.links {
            let state = link.snapshot();
            up += i64::from(state.up);
            siblings += i64::from(!state.is_self);
            self.depth
                .with_label_values(&[link.label()])
                .set(state.depth as i64);
        }
        self.up.set(up);
        self.siblings.set(siblings);
        let mut out = self.up.collect();
        out.extend(self.siblings.collect());
        out.extend(self.depth.collect());
        out
    }
}
