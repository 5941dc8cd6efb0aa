//! The wire contract of `SecretClient`, checked over a `tower-test` mock service (no server):
//! URLs and query strings, methods, patch content type and body, and status-code mapping.
//! Timeouts are hang guards only.

use std::collections::BTreeMap;
use std::pin::{Pin, pin};
use std::time::Duration;

use futures::{Stream, StreamExt as _};
use http::{Method, Request, Response};
use http_body_util::BodyExt as _;
use kube::client::Body;
use nodeplan::remote::client::{SecretClient, SecretRef, SecretSnapshot, WriteError};
use tower_test::mock;

const GUARD: Duration = Duration::from_secs(10);
const NS: &str = "fleet-default";
const NAME: &str = "m-plan";

type Handle = mock::Handle<Request<Body>, Response<Body>>;
type Responder = mock::SendResponse<Response<Body>>;

fn client() -> (SecretClient, Handle) {
    let (svc, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let sc =
        SecretClient::new(kube::Client::new(svc, NS), SecretRef { namespace: NS.to_string(), name: NAME.to_string() });
    (sc, handle)
}

async fn next_request(handle: &mut Pin<&mut Handle>) -> (Request<Body>, Responder) {
    tokio::time::timeout(GUARD, handle.as_mut().next_request())
        .await
        .expect("a request within the guard")
        .expect("the client hung up")
}

async fn body_json(req: Request<Body>) -> serde_json::Value {
    let bytes = req.into_body().collect().await.expect("read request body").to_bytes();
    serde_json::from_slice(&bytes).expect("request body is JSON")
}

fn json_response(code: u16, value: &serde_json::Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Body::from(serde_json::to_vec(value).expect("serialise")))
        .expect("response")
}

fn secret_json(rv: &str, data: serde_json::Value) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "v1", "kind": "Secret", "type": "rke.cattle.io/machine-plan",
        "metadata": {"name": NAME, "namespace": NS, "uid": "uid-1", "resourceVersion": rv,
                     "annotations": {"rke.cattle.io/plan-last-updated": "t"}},
        "data": data,
    })
}

fn status(code: u16, reason: &str) -> serde_json::Value {
    serde_json::json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "reason": reason, "code": code, "message": format!("{reason} from the mock")})
}

fn list_json(rv: &str, items: Vec<serde_json::Value>) -> serde_json::Value {
    serde_json::json!({"apiVersion": "v1", "kind": "SecretList", "metadata": {"resourceVersion": rv}, "items": items})
}

fn assert_field_selected(req: &Request<Body>) {
    assert_eq!(req.method(), Method::GET);
    assert_eq!(req.uri().path(), format!("/api/v1/namespaces/{NS}/secrets"));
    let query = req.uri().query().unwrap_or_default();
    assert!(query.contains(&format!("fieldSelector=metadata.name%3D{NAME}")), "query {query}");
}

fn is_watch(req: &Request<Body>) -> bool {
    req.uri().query().unwrap_or_default().split('&').any(|p| p == "watch=true")
}

async fn next_item(stream: &mut Pin<Box<dyn Stream<Item = Option<SecretSnapshot>> + Send>>) -> Option<SecretSnapshot> {
    tokio::time::timeout(GUARD, stream.next()).await.expect("a watch item within the guard").expect("stream ended")
}

#[tokio::test]
async fn watch_lists_and_watches_with_the_name_field_selector() {
    let (sc, handle) = client();
    let mut handle = pin!(handle);
    let mut stream: Pin<Box<dyn Stream<Item = Option<SecretSnapshot>> + Send>> = Box::pin(sc.watch());

    let server = async {
        let (req, send) = next_request(&mut handle).await;
        assert_field_selected(&req);
        assert!(!is_watch(&req), "first the list: {}", req.uri());
        send.send_response(json_response(200, &list_json("10", vec![])));

        let (req, send) = next_request(&mut handle).await;
        assert_field_selected(&req);
        assert!(is_watch(&req), "then the watch: {}", req.uri());
        let query = req.uri().query().unwrap_or_default().to_string();
        assert!(query.split('&').any(|p| p == "resourceVersion=10"), "watch resumes from the list's rv: {query}");
        let event =
            serde_json::json!({"type": "ADDED", "object": secret_json("11", serde_json::json!({"plan": "e30="}))});
        let mut line = serde_json::to_vec(&event).expect("serialise");
        line.push(b'\n');
        send.send_response(Response::builder().status(200).body(Body::from(line)).expect("response"));
    };
    let client_side = async {
        assert_eq!(next_item(&mut stream).await, None, "the list had no such secret");
        let snap = next_item(&mut stream).await.expect("the ADDED secret");
        assert_eq!(snap.uid, "uid-1");
        assert_eq!(snap.resource_version, "11");
        assert_eq!(snap.data.get("plan").map(Vec::as_slice), Some(&b"{}"[..]));
        assert_eq!(snap.annotations.get("rke.cattle.io/plan-last-updated").map(String::as_str), Some("t"));
    };
    tokio::join!(server, client_side);
}

#[tokio::test]
async fn watch_relists_after_410_gone_and_keeps_going() {
    let (sc, handle) = client();
    let mut handle = pin!(handle);
    let mut stream: Pin<Box<dyn Stream<Item = Option<SecretSnapshot>> + Send>> = Box::pin(sc.watch());

    let server = async {
        let (req, send) = next_request(&mut handle).await;
        assert!(!is_watch(&req));
        send.send_response(json_response(200, &list_json("10", vec![secret_json("10", serde_json::json!({}))])));

        let (req, send) = next_request(&mut handle).await;
        assert!(is_watch(&req));
        let gone = serde_json::json!({"type": "ERROR", "object": status(410, "Expired")});
        let mut line = serde_json::to_vec(&gone).expect("serialise");
        line.push(b'\n');
        send.send_response(Response::builder().status(200).body(Body::from(line)).expect("response"));

        // After the 410 (and kube's backoff), the watcher starts over with a fresh list.
        let (req, send) = next_request(&mut handle).await;
        assert_field_selected(&req);
        assert!(!is_watch(&req), "a relist after 410: {}", req.uri());
        send.send_response(json_response(200, &list_json("20", vec![secret_json("20", serde_json::json!({}))])));
    };
    let client_side = async {
        assert_eq!(next_item(&mut stream).await.map(|s| s.resource_version), Some("10".to_string()));
        assert_eq!(next_item(&mut stream).await.map(|s| s.resource_version), Some("20".to_string()));
    };
    tokio::join!(server, client_side);
}

/// After an outage (the watch cannot be started again: here a 503) the watch lists again, and
/// the Secret is yielded as it is even though it did not change: the caller learns that the API
/// server is back (kube's watcher alone would resume from the last resourceVersion silently).
#[tokio::test]
async fn watch_lists_again_after_an_error_and_yields_the_unchanged_secret() {
    let (sc, handle) = client();
    let mut handle = pin!(handle);
    let mut stream: Pin<Box<dyn Stream<Item = Option<SecretSnapshot>> + Send>> = Box::pin(sc.watch());

    let server = async {
        let (req, send) = next_request(&mut handle).await;
        assert!(!is_watch(&req));
        send.send_response(json_response(200, &list_json("10", vec![secret_json("10", serde_json::json!({}))])));

        // The watch's connection breaks (the apiserver went away).
        let (req, send) = next_request(&mut handle).await;
        assert!(is_watch(&req));
        send.send_response(json_response(503, &status(503, "ServiceUnavailable")));

        // After the backoff: a list, not a watch resumed from resourceVersion 10.
        let (req, send) = next_request(&mut handle).await;
        assert_field_selected(&req);
        assert!(!is_watch(&req), "a list after the error: {}", req.uri());
        send.send_response(json_response(200, &list_json("12", vec![secret_json("10", serde_json::json!({}))])));
    };
    let client_side = async {
        assert_eq!(next_item(&mut stream).await.map(|s| s.resource_version), Some("10".to_string()));
        let again = next_item(&mut stream).await;
        assert_eq!(again.map(|s| s.resource_version), Some("10".to_string()), "the unchanged secret, again");
    };
    tokio::join!(server, client_side);
}

/// The Secret as read, for an update's base.
fn read_base(rv: &str) -> SecretSnapshot {
    SecretSnapshot {
        uid: "u".into(),
        resource_version: rv.into(),
        data: BTreeMap::from([("plan".to_string(), b"{}".to_vec()), ("probe-statuses".to_string(), b"x".to_vec())]),
        ..SecretSnapshot::default()
    }
}

#[tokio::test]
async fn update_data_sends_the_secret_with_the_rv_precondition_and_base64_values() {
    let (sc, handle) = client();
    let mut handle = pin!(handle);
    let mut updates = BTreeMap::new();
    updates.insert("plan-state".to_string(), Some(b"in-progress".to_vec()));
    updates.insert("plan-checkpoint".to_string(), Some(Vec::new()));
    updates.insert("probe-statuses".to_string(), None);

    let server = async {
        let (req, send) = next_request(&mut handle).await;
        assert_eq!(req.method(), Method::PUT);
        assert_eq!(req.uri().path(), format!("/api/v1/namespaces/{NS}/secrets/{NAME}"));
        let body = body_json(req).await;
        assert_eq!(body["metadata"]["resourceVersion"], "41");
        assert_eq!((&body["metadata"]["name"], &body["metadata"]["uid"]), (&NAME.into(), &"u".into()));
        assert_eq!(
            body["data"],
            serde_json::json!({"plan": "e30=", "plan-state": "aW4tcHJvZ3Jlc3M=", "plan-checkpoint": ""})
        );
        send.send_response(json_response(
            200,
            &secret_json("42", serde_json::json!({"plan-state": "aW4tcHJvZ3Jlc3M=", "plan-checkpoint": ""})),
        ));
    };
    let base = read_base("41");
    let (_, result) = tokio::join!(server, sc.update_data(&base, &updates));
    let snap = result.expect("updated");
    assert_eq!(snap.resource_version, "42");
    assert_eq!(snap.data.get("plan-state").map(Vec::as_slice), Some(&b"in-progress"[..]));
    assert_eq!(snap.data.get("plan-checkpoint").map(Vec::as_slice), Some(&b""[..]));
}

async fn update_answered_with(code: u16, reason: &str) -> Result<SecretSnapshot, WriteError> {
    let (sc, handle) = client();
    let mut handle = pin!(handle);
    let server = async {
        let (req, send) = next_request(&mut handle).await;
        assert_eq!(req.method(), Method::PUT);
        send.send_response(json_response(code, &status(code, reason)));
    };
    let updates = BTreeMap::from([("k".to_string(), Some(b"v".to_vec()))]);
    let base = read_base("41");
    let (_, result) = tokio::join!(server, sc.update_data(&base, &updates));
    result
}

#[tokio::test]
async fn update_data_maps_409_to_conflict() {
    assert_eq!(update_answered_with(409, "Conflict").await, Err(WriteError::Conflict));
}

#[tokio::test]
async fn update_data_maps_404_to_not_found() {
    assert_eq!(update_answered_with(404, "NotFound").await, Err(WriteError::NotFound));
}

#[tokio::test]
async fn update_data_maps_other_failures_to_a_one_line_other() {
    match update_answered_with(500, "InternalError").await {
        Err(WriteError::Other(msg)) => {
            assert!(msg.contains("500") && !msg.contains('\n'), "{msg}");
        }
        other => panic!("expected Other, got {other:?}"),
    }
}
