//! The `DevicePlugin` gRPC service for one resource.
//!
//! `Allocate` before the node is ready for containers: the agent registers
//! with the kubelet before its first pass has made the device nodes, the
//! container runtime's configuration and the CDI spec
//! (`stages::BEFORE_ALLOCATION`). An allocation answered then would name
//! control nodes that do not exist yet (they are left out of the
//! response) or CDI devices no spec describes: a container without its GPU.
//! So an `Allocate` that arrives first waits for those stages (they
//! normally take milliseconds), at most [`ALLOCATE_WAIT`]; past that it is
//! refused with `Unavailable`, naming what it waited for, and the kubelet
//! fails the pod's admission (its controller makes a new pod). Waiting is
//! for the first pass only: the stages then have run, whatever they came
//! to (a device node that could not be made is `status`'s to tell, as it
//! was before the plugin registered first). `ListAndWatch` and
//! `GetPreferredAllocation` never wait.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use gpu_agent_proto::deviceplugin::v1beta1::device_plugin_server::{
    DevicePlugin, DevicePluginServer,
};
use gpu_agent_proto::deviceplugin::v1beta1::{
    AllocateRequest, AllocateResponse, ContainerPreferredAllocationResponse, Device,
    DevicePluginOptions, Empty, HEALTHY, ListAndWatchResponse, NumaNode, PreStartContainerRequest,
    PreStartContainerResponse, PreferredAllocationRequest, PreferredAllocationResponse,
    TopologyInfo, UNHEALTHY,
};
use hostlib::HostRoot;
use tokio::sync::watch;
use tokio_stream::Stream;
use tokio_stream::wrappers::WatchStream;
use tonic::{Request, Response, Status};

use super::allocate;
use super::preferred;
use super::resources::{PluginSettings, Resource};
use gpu_model::inventory::Inventory;

/// `ListAndWatch` streams one plugin server (one socket) serves at once;
/// the next is refused with `ResourceExhausted`. The kubelet opens one per
/// registration, and every registration is on a new socket with a new
/// server, so a client holding streams never keeps the kubelet out.
pub const MAX_LIST_STREAMS: usize = 64;
/// The largest request message a plugin server decodes (tonic refuses a
/// larger one by its length prefix, `OutOfRange`, before buffering it).
/// Over 20,000 device IDs of our longest shape fit; the ID count is then
/// bounded by the devices advertised ([`allocate::check_size`]).
pub const MAX_REQUEST_BYTES: usize = 1 << 20;
/// HTTP/2 streams (calls) one connection may have open at once.
pub const MAX_CALLS_PER_CONNECTION: u32 = 256;
/// How long an `Allocate` waits for the first pass to make what containers
/// need before it is refused: a runtime reload (containerd restarted by
/// systemd) can take seconds; the kubelet holds the pod's admission
/// meanwhile and sets no deadline of its own.
pub const ALLOCATE_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// What allocations wait for: `Some(what)` while the node is not ready for
/// containers (`what`: the stages still to run), `None` once it is.
pub type Preparing = watch::Receiver<Option<String>>;

/// The tonic service for `svc`, with its message limits.
pub fn grpc_service(svc: PluginService) -> DevicePluginServer<PluginService> {
    DevicePluginServer::new(svc).max_decoding_message_size(MAX_REQUEST_BYTES)
}

/// The transport every plugin server runs on, with its HTTP/2 limits.
pub fn transport() -> tonic::transport::Server {
    tonic::transport::Server::builder().max_concurrent_streams(MAX_CALLS_PER_CONNECTION)
}

/// The options every gpu-agent plugin announces.
pub fn options() -> DevicePluginOptions {
    DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    }
}

/// The kubelet's view of a resource's devices.
pub fn list_response(resource: &Resource) -> ListAndWatchResponse {
    ListAndWatchResponse {
        devices: resource
            .devices
            .iter()
            .map(|d| Device {
                id: d.id.clone(),
                health: if d.healthy { HEALTHY } else { UNHEALTHY }.to_string(),
                topology: d.numa_node.map(|n| TopologyInfo {
                    nodes: vec![NumaNode { id: i64::from(n) }],
                }),
            })
            .collect(),
    }
}

/// Serves one resource. The resource (its devices and their health) comes
/// through a watch channel: every change is sent to `ListAndWatch` streams.
#[derive(Debug, Clone)]
pub struct PluginService {
    resource: watch::Receiver<Resource>,
    inventory: Arc<Inventory>,
    settings: Arc<PluginSettings>,
    dev_root: HostRoot,
    on_list: ListHook,
    /// `ListAndWatch` streams open now (shared by the clones tonic makes).
    streams: Arc<AtomicUsize>,
    /// `ListAndWatch` streams refused so far (logged at 1, 2, 4, 8...).
    refused: Arc<AtomicUsize>,
    /// True (or dropped) once this server stops: its `ListAndWatch` streams
    /// end with `Unavailable`, so a graceful shutdown does not wait on
    /// streams that would otherwise last as long as their clients.
    stopping: Option<watch::Receiver<bool>>,
    /// Allocations wait (up to the duration) while this says the node is
    /// not ready for containers.
    preparing: Option<(Preparing, std::time::Duration)>,
}

/// Called when a `ListAndWatch` stream opens (the kubelet lists the devices).
#[derive(Clone, Default)]
struct ListHook(Option<Arc<dyn Fn() + Send + Sync>>);

impl std::fmt::Debug for ListHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "ListHook(set)"
        } else {
            "ListHook(none)"
        })
    }
}

impl PluginService {
    pub fn new(
        resource: watch::Receiver<Resource>,
        inventory: Arc<Inventory>,
        settings: Arc<PluginSettings>,
        dev_root: HostRoot,
    ) -> Self {
        PluginService {
            resource,
            inventory,
            settings,
            dev_root,
            on_list: ListHook::default(),
            streams: Arc::default(),
            refused: Arc::default(),
            stopping: None,
            preparing: None,
        }
    }

    /// Holds `Allocate` (up to `wait`, then refuses it) while `preparing`
    /// says the node is not ready for containers.
    pub fn with_preparing(mut self, preparing: Preparing, wait: std::time::Duration) -> Self {
        self.preparing = Some((preparing, wait));
        self
    }

    /// Waits until the node is ready for containers, or says why not.
    async fn prepared(&self, resource: &str) -> Result<(), Status> {
        let Some((rx, wait)) = &self.preparing else {
            return Ok(());
        };
        let mut rx = rx.clone();
        let Some(what) = rx.borrow_and_update().clone() else {
            return Ok(());
        };
        let started = std::time::Instant::now();
        tracing::info!(resource = %resource, waiting_for = %what, "an allocation waits for the node to be ready for containers");
        let refused = |why: &str| {
            let why = format!(
                "{resource}: the node is not ready for containers yet: gpu-agent's first pass has not finished {what} ({why}); try again"
            );
            tracing::warn!(resource = %resource, "refused an allocation: {why}");
            Status::unavailable(why)
        };
        match tokio::time::timeout(*wait, rx.wait_for(Option::is_none)).await {
            Ok(Ok(_)) => {
                tracing::info!(
                    resource = %resource,
                    waited_ms = started.elapsed().as_secs_f64() * 1e3,
                    "the node is ready for containers; allocating"
                );
                Ok(())
            }
            Ok(Err(_)) => Err(refused("the agent is stopping")),
            Err(_) => Err(refused(&format!("waited {} s", wait.as_secs_f64()))),
        }
    }

    /// Ends every `ListAndWatch` stream (open or opened later) with
    /// `Unavailable` once `stopping` is true or its sender is dropped.
    pub fn with_stopping(mut self, stopping: watch::Receiver<bool>) -> Self {
        self.stopping = Some(stopping);
        self
    }

    /// Calls `f` whenever a `ListAndWatch` stream opens.
    pub fn on_list(mut self, f: impl Fn() + Send + Sync + 'static) -> Self {
        self.on_list = ListHook(Some(Arc::new(f)));
        self
    }
}

type ListStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for PluginService {
    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(options()))
    }

    type ListAndWatchStream = ListStream;

    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let slot = StreamSlot::take(&self.streams).ok_or_else(|| {
            let name = self.resource.borrow().name.clone();
            let refused = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
            if refused.is_power_of_two() {
                tracing::warn!(resource = %name, limit = MAX_LIST_STREAMS, refused, "refused a ListAndWatch stream: too many open");
            }
            Status::resource_exhausted(format!(
                "{name}: {MAX_LIST_STREAMS} ListAndWatch streams are open on this socket, the most served at once"
            ))
        })?;
        if let Some(hook) = &self.on_list.0 {
            hook();
        }
        // No task and no queue per stream: the stream is polled when the
        // connection can send, and a client that reads slowly gets the
        // latest list, not every one in between.
        let stop: Option<StopFuture> = self.stopping.clone().map(|mut rx| {
            Box::pin(async move {
                // Err: the sender is gone, the server with it.
                let _ = rx.wait_for(|stopping| *stopping).await;
            }) as StopFuture
        });
        let stream = Counted {
            inner: WatchStream::new(self.resource.clone()),
            stop,
            name: self.resource.borrow().name.clone(),
            slot: Some(slot),
        };
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let resource = self.resource.borrow().clone();
        let request = request.into_inner();
        let refuse = |e: allocate::AllocateError| {
            tracing::warn!(resource = %resource.name, error = %e, "refused a preferred allocation");
            Status::invalid_argument(e.to_string())
        };
        allocate::check_size(
            &resource,
            "GetPreferredAllocation",
            request.container_requests.len(),
            [],
        )
        .map_err(refuse)?;
        let mut out = PreferredAllocationResponse::default();
        for req in request.container_requests {
            for list in [&req.available_device_i_ds, &req.must_include_device_i_ds] {
                allocate::check_size(&resource, "GetPreferredAllocation", 1, [list.as_slice()])
                    .map_err(refuse)?;
            }
            let size = usize::try_from(req.allocation_size).map_err(|_| {
                Status::invalid_argument(format!("{}: negative allocation size", resource.name))
            })?;
            if size > resource.devices.len() {
                return Err(Status::invalid_argument(format!(
                    "{}: allocation size {size}; this resource advertises {}",
                    resource.name,
                    resource.devices.len()
                )));
            }
            let ids = preferred::preferred(
                &resource,
                &self.inventory,
                self.settings.allocation_policy,
                &req.available_device_i_ds,
                &req.must_include_device_i_ds,
                size,
            )
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
            out.container_responses
                .push(ContainerPreferredAllocationResponse { device_i_ds: ids });
        }
        Ok(Response::new(out))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let name = self.resource.borrow().name.clone();
        self.prepared(&name).await?;
        let resource = self.resource.borrow().clone();
        let request = request.into_inner();
        allocate::check_size(
            &resource,
            "Allocate",
            request.container_requests.len(),
            request
                .container_requests
                .iter()
                .map(|c| c.devices_ids.as_slice()),
        )
        .map_err(|e| {
            tracing::warn!(resource = %resource.name, error = %e, "refused an allocation");
            Status::invalid_argument(e.to_string())
        })?;
        let mut out = AllocateResponse::default();
        let mut devices: Vec<String> = Vec::new();
        for req in request.container_requests {
            devices.push(req.devices_ids.join(","));
            let resp = allocate::container_response(
                &resource,
                &self.settings,
                &self.dev_root,
                &req.devices_ids,
            )
            .map_err(|e| {
                tracing::warn!(resource = %resource.name, error = %e, "refused an allocation");
                Status::invalid_argument(e.to_string())
            })?;
            out.container_responses.push(resp);
            gpu_model::series::allocated(&resource.name);
        }
        tracing::info!(
            resource = %resource.name,
            containers = out.container_responses.len(),
            devices = %devices.join(" "),
            "allocated"
        );
        Ok(Response::new(out))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        // pre_start_required is false: the kubelet does not call this; answer anyway.
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

/// One of a server's [`MAX_LIST_STREAMS`]; given back when the stream is
/// dropped (the client went away or the server stopped).
#[derive(Debug)]
struct StreamSlot(Arc<AtomicUsize>);

impl StreamSlot {
    fn take(count: &Arc<AtomicUsize>) -> Option<Self> {
        count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_LIST_STREAMS).then_some(n + 1)
            })
            .ok()
            .map(|_| StreamSlot(count.clone()))
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

type StopFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A resource's lists, holding a stream slot while it lives; ends with
/// `Unavailable` when its server stops.
struct Counted {
    inner: WatchStream<Resource>,
    /// Resolves when the server stops (None: never).
    stop: Option<StopFuture>,
    name: String,
    /// None once the stream has ended (the slot is given back at once).
    slot: Option<StreamSlot>,
}

impl Stream for Counted {
    type Item = Result<ListAndWatchResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.slot.is_none() {
            return Poll::Ready(None);
        }
        if let Some(stop) = self.stop.as_mut()
            && stop.as_mut().poll(cx).is_ready()
        {
            self.slot = None;
            self.stop = None;
            tracing::debug!(resource = %self.name, "ended a ListAndWatch stream: the server stops");
            return Poll::Ready(Some(Err(Status::unavailable(format!(
                "{}: this device-plugin server is stopping (the kubelet restarted, the resource \
                 is gone, or the agent stops); the agent registers again on a new socket \
                 unless it is stopping",
                self.name
            )))));
        }
        Pin::new(&mut self.inner)
            .poll_next(cx)
            .map(|r| r.map(|r| Ok(list_response(&r))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::build;
    use crate::test_support::inventory_of;
    use gpu_agent_proto::deviceplugin::v1beta1::ContainerAllocateRequest;
    use std::time::Duration;

    /// A service for the first whole-GPU resource of an 8x H100 node, and
    /// a request for its first device.
    fn service() -> (PluginService, AllocateRequest) {
        let inv = Arc::new(inventory_of("h100-sxm-8"));
        let settings = PluginSettings::default();
        let r = build(&inv, &settings).unwrap().remove(0);
        let req = AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: vec![r.devices[0].id.clone()],
            }],
        };
        let (_tx, rx) = watch::channel(r);
        let svc = PluginService::new(rx, inv, Arc::new(settings), HostRoot::system());
        (svc, req)
    }

    #[tokio::test(start_paused = true)]
    async fn an_allocation_waits_until_the_node_is_ready_for_containers() {
        let (svc, req) = service();
        let (tx, rx) = watch::channel(Some("devnodes, runtime, cdi".to_string()));
        let svc = svc.with_preparing(rx, Duration::from_secs(10));
        let call = tokio::spawn({
            let svc = svc.clone();
            let req = req.clone();
            async move { svc.allocate(Request::new(req)).await }
        });
        // Still waiting after 9 s (the clock is paused: no real wait).
        tokio::time::sleep(Duration::from_secs(9)).await;
        assert!(!call.is_finished());
        tx.send_replace(None);
        let resp = call.await.unwrap().unwrap().into_inner();
        assert_eq!(resp.container_responses.len(), 1);
        assert!(
            resp.container_responses[0]
                .envs
                .contains_key("NVIDIA_VISIBLE_DEVICES")
        );
        // Once ready, allocations do not wait at all.
        let t = tokio::time::Instant::now();
        svc.allocate(Request::new(req)).await.unwrap();
        assert_eq!(t.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn an_allocation_that_waits_too_long_is_refused_naming_why() {
        let (svc, req) = service();
        let (tx, rx) = watch::channel(Some("devnodes, cdi".to_string()));
        let svc = svc.with_preparing(rx, Duration::from_secs(10));
        let t = tokio::time::Instant::now();
        let e = svc.allocate(Request::new(req.clone())).await.unwrap_err();
        assert_eq!(t.elapsed(), Duration::from_secs(10));
        assert_eq!(e.code(), tonic::Code::Unavailable);
        assert_eq!(
            e.message(),
            "nvidia.com/gpu: the node is not ready for containers yet: gpu-agent's first pass has not finished devnodes, cdi (waited 10 s); try again"
        );
        // The agent stopping meanwhile refuses it at once.
        drop(tx);
        let e = svc.allocate(Request::new(req)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable);
        assert!(
            e.message().contains("(the agent is stopping)"),
            "{}",
            e.message()
        );
    }

    #[tokio::test]
    async fn without_a_gate_an_allocation_is_answered_at_once() {
        let (svc, req) = service();
        let resp = svc.allocate(Request::new(req)).await.unwrap().into_inner();
        assert_eq!(resp.container_responses.len(), 1);
    }
}
