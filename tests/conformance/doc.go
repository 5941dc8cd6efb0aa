// Package conformance drives the built nodeplan binary, in remote mode, against a real
// kube-apiserver through the calls Rancher's orchestrator makes on a machine-plan Secret, and
// decodes every key the agent writes with Rancher's own types.
//
// Run it with tools/test.sh (after the Rust tests), or by hand:
//
//	cd tests/conformance && NODEPLAN_K8S_BIN=/var/tmp/nodeplan-k8s/bin \
//	  NODEPLAN_BIN=../../target/debug/nodeplan go test -count=1 -v .
//
// NODEPLAN_K8S_BIN names a directory holding etcd and kube-apiserver (1.20 from
// tools/build-kube-apiserver.sh, or a current one laid out the same way); NODEPLAN_BIN the agent
// binary (default ../../target/debug/nodeplan). Without either the suite skips with a loud line;
// with NODEPLAN_CI set it fails instead.
//
// # What comes from the Go module proxy, and what stands in
//
// Everything here is fetched through the Go module proxy and pinned in go.mod/go.sum; no source
// of another project is copied.
//
//   - github.com/rancher/rancher/pkg/plan v0.0.0-20260428222332-2696373f4152 is the version of
//     Rancher's plan module the proxy serves here (the one Rancher's own pkg/apis requires). Its
//     types are the ones Rancher and system-agent (whose main imports this module for them)
//     decode the agent's keys with: plan.Plan and plan.Parse/plan.Checksum for the plan,
//     plan.ProbeStatus for probe-statuses, plan.PeriodicInstructionOutput for
//     applied-periodic-output.
//   - The later versions of that module add the Store (AssignPlan, CancelPlan, Status and the
//     retry after the 30 s cooldown), the annotation and key constants, the plan states, the
//     checkpoint struct (Rancher PR #56931 and after) and the output readers (ReadAppliedOutput,
//     ReadAppliedPeriodicOutput). The proxy lists no versions of the module; of the later ones it
//     serves v0.0.0-20260508124826-0b6b24d9811e (system-agent's main pins it) as .mod and .zip
//     but refuses its .info ("403 This module version is not available"), so go.cancelled.mod
//     names it with go.sum lines made from those files: that version has the plan states
//     (spelling cancel "cancelled") and no Store. The proxy refuses github.com/rancher/rancher
//     itself, where the operations code (the pause/cancel sync) and the plan-secret controller
//     live. What stands in for them is rancher_test.go: a Store written for this suite from
//     Rancher's documented behaviour (docs/rancher-keys.md, the table this suite checks), with the
//     same method shapes, the same keys and the same 30 s cooldown; the operations code's
//     pause/cancel annotation sync; the plan-secret controller's appliedPlan copy and
//     probes-passed stamp; the checkpoint struct (every field omitempty, decoded strictly so that
//     a field Rancher does not know fails the test); and decodeOneTimeOutput for applied-output
//     and failed-output (gzip of a JSON map of instruction name to bytes).
//   - github.com/rancher/system-agent: the proxy lists no versions, and refused the revision of
//     its main tried (002e2e97e622, which has the plan-state flow); the pause/cancel pull request
//     (#453) has no revision known here. The release it serves (v0.3.11) predates plan-state, its
//     ProbeStatus and PeriodicInstructionOutput are the same shapes as pkg/plan's, and its prober
//     would pull k8s.io/kubernetes into the build, so it is not used: pkg/plan's types are what
//     system-agent's main decodes with.
//   - k8s.io/client-go v0.34.3 talks to the API server (its Secrets API is the same on 1.20 and
//     current releases).
//
// # Two spellings of cancel
//
// spelling_canceled_test.go (the default build) names the newer spelling, "canceled" for the state
// and plan.cattle.io/canceled; spelling_cancelled_test.go (-tags cancelled, with
// -modfile=go.cancelled.mod) takes the May module's own constants and IsTerminal, with
// plan.cattle.io/cancelled. Every subtest then plays a Rancher of that spelling.
//
// Fetching a module the first time needs no checksum-database look-up: go.sum holds every hash.
// (Adding or bumping a rancher module does: the checksum database here answers 404 for them, so
// run that `go get` with GONOSUMDB=github.com/rancher and review the go.sum lines it adds.)
//
// # What is checked
//
// Every subtest starts its own agent on its own machine-plan Secret and plays Rancher: the Store
// assigns, cancels and retries; Status reports; the operations sync pauses, resumes and cancels;
// the plan-secret controller stamps probes-passed. After each, checkAgentWrites decodes every data
// key with Rancher's types and reads managedFields: the agent's writes belong to the field manager
// nodeplan (its User-Agent), which must own no key or annotation of Rancher's, so it never wrote
// plan.cattle.io/writer or plan.cattle.io/attempt. docs/rancher-keys.md is the table of keys, with
// the subtest that checks each.
package conformance
