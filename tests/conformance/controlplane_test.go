package conformance

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// The control plane: etcd and kube-apiserver from $NODEPLAN_K8S_BIN on loopback, in a temp dir,
// reached with a system:masters bearer token (as tests/k8s_support/mod.rs starts them). Both are
// started by this process and killed by pid (SIGKILL, then reaped) in stop.

const (
	adminToken   = "nodeplan-conformance-token"
	readyTimeout = 90 * time.Second
	// userAgent is the field manager of every write this suite makes as Rancher: managedFields
	// then tell the agent's writes from Rancher's.
	userAgent = "rancher-conformance"
)

type controlPlane struct {
	dir       string
	bin       string
	version   string
	server    string
	caPEM     []byte
	etcd      *proc
	apiserver *proc
}

// proc is a child process and a channel closed once it has exited (and been reaped).
type proc struct {
	cmd  *exec.Cmd
	done chan struct{}
}

func (p *proc) exited() bool {
	if p == nil {
		return false
	}
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// minorOf is the minor version of "v1.20.2", 0 when unreadable.
func minorOf(version string) int {
	parts := strings.Split(strings.TrimPrefix(version, "v"), ".")
	if len(parts) < 2 {
		return 0
	}
	n, _ := strconv.Atoi(parts[1])
	return n
}

// apiserverVersion reads `kube-apiserver --version` ("Kubernetes v1.20.2").
func apiserverVersion(bin string) (string, error) {
	out, err := exec.Command(filepath.Join(bin, "kube-apiserver"), "--version").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("kube-apiserver --version: %v: %s", err, out)
	}
	f := strings.Fields(string(out))
	if len(f) == 0 {
		return "", fmt.Errorf("kube-apiserver --version printed nothing")
	}
	return f[len(f)-1], nil
}

// freePorts returns n distinct loopback ports free at the time of the call.
func freePorts(n int) ([]int, error) {
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	var ports []int
	for i := 0; i < n; i++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

func startProc(dir, name string, path string, args ...string) (*proc, error) {
	log, err := os.OpenFile(filepath.Join(dir, name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(path, args...)
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		log.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	log.Close()
	watchdog(cmd.Process.Pid)
	p := &proc{cmd: cmd, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(p.done) }()
	return p, nil
}

// watchdog kills pid once this test process is gone (a `go test` timeout exits without running
// any cleanup): a tiny sh polling this process once a second, as tests/k8s_support does.
func watchdog(pid int) {
	w := exec.Command("sh", "-c", `while kill -0 "$1" 2>/dev/null; do sleep 1; done; kill -9 "$2" 2>/dev/null; exit 0`,
		"nodeplan-conformance-watchdog", fmt.Sprint(os.Getpid()), fmt.Sprint(pid))
	if w.Start() == nil {
		go func() { _ = w.Wait() }()
	}
}

func killProc(p *proc) {
	if p == nil {
		return
	}
	_ = p.cmd.Process.Kill()
	<-p.done
}

func run(name string, args ...string) error {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %v: %v: %s", name, args, err, out)
	}
	return nil
}

// startControlPlane starts etcd and kube-apiserver and waits until /readyz says ok. A port taken
// between the choice and the bind is retried on other ports (twice).
func startControlPlane(bin string) (*controlPlane, error) {
	version, err := apiserverVersion(bin)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "nodeplan-conformance-")
	if err != nil {
		return nil, err
	}
	cp := &controlPlane{dir: dir, bin: bin, version: version}
	if err := run("openssl", "genrsa", "-out", filepath.Join(dir, "sa.key"), "2048"); err != nil {
		return cp, err
	}
	if err := run("openssl", "rsa", "-pubout", "-in", filepath.Join(dir, "sa.key"), "-out", filepath.Join(dir, "sa.pub")); err != nil {
		return cp, err
	}
	if err := os.WriteFile(filepath.Join(dir, "tokens.csv"), []byte(adminToken+",admin,admin-uid,system:masters\n"), 0o600); err != nil {
		return cp, err
	}
	for attempt := 1; ; attempt++ {
		err = cp.launch()
		if err == nil {
			return cp, nil
		}
		cp.kill()
		logs, _ := os.ReadFile(filepath.Join(dir, "apiserver.log"))
		elogs, _ := os.ReadFile(filepath.Join(dir, "etcd.log"))
		if attempt == 3 || !strings.Contains(string(logs)+string(elogs), "address already in use") {
			return cp, fmt.Errorf("control plane in %s (kube-apiserver %s): %w\n--- apiserver.log (tail) ---\n%s", dir, version, err, tail(logs, 40))
		}
		for _, f := range []string{"apiserver.log", "etcd.log"} {
			_ = os.Rename(filepath.Join(dir, f), filepath.Join(dir, fmt.Sprintf("%s.attempt%d", f, attempt)))
		}
		_ = os.RemoveAll(filepath.Join(dir, "etcd"))
	}
}

func tail(b []byte, n int) string {
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func (cp *controlPlane) launch() error {
	ports, err := freePorts(3)
	if err != nil {
		return err
	}
	for _, sub := range []string{"certs", "etcd"} {
		if err := os.MkdirAll(filepath.Join(cp.dir, sub), 0o700); err != nil {
			return err
		}
	}
	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", ports[0])
	peerURL := fmt.Sprintf("http://127.0.0.1:%d", ports[1])
	cp.etcd, err = startProc(cp.dir, "etcd", filepath.Join(cp.bin, "etcd"),
		"--name=default", "--data-dir="+filepath.Join(cp.dir, "etcd"),
		"--listen-client-urls="+etcdURL, "--advertise-client-urls="+etcdURL,
		"--listen-peer-urls="+peerURL, "--initial-advertise-peer-urls="+peerURL,
		"--initial-cluster=default="+peerURL)
	if err != nil {
		return err
	}
	cp.server = fmt.Sprintf("https://127.0.0.1:%d", ports[2])
	args := []string{"--etcd-servers=" + etcdURL,
		fmt.Sprintf("--secure-port=%d", ports[2]),
		"--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
		"--cert-dir=" + filepath.Join(cp.dir, "certs"),
		"--token-auth-file=" + filepath.Join(cp.dir, "tokens.csv"),
		"--authorization-mode=RBAC",
		"--service-account-issuer=https://kubernetes.default.svc",
		"--service-account-key-file=" + filepath.Join(cp.dir, "sa.pub"),
		"--service-account-signing-key-file=" + filepath.Join(cp.dir, "sa.key"),
		"--service-cluster-ip-range=10.0.0.0/24",
		"--disable-admission-plugins=ServiceAccount"}
	if minorOf(cp.version) >= 21 {
		// Later releases refuse the loopback advertise address as the kubernetes Service's
		// endpoint and exit; nothing here reads those endpoints (as tools/start-apiserver.sh).
		args = append(args, "--endpoint-reconciler-type=none")
	}
	cp.apiserver, err = startProc(cp.dir, "apiserver", filepath.Join(cp.bin, "kube-apiserver"), args...)
	if err != nil {
		return err
	}
	return cp.waitReady()
}

func (cp *controlPlane) waitReady() error {
	deadline := time.Now().Add(readyTimeout)
	last := "no attempt yet"
	for {
		if cp.apiserver.exited() || cp.etcd.exited() {
			return errors.New("kube-apiserver or etcd exited")
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not ready within %v; last: %s", readyTimeout, last)
		}
		if cp.caPEM == nil {
			if ca := caFromCertFile(filepath.Join(cp.dir, "certs", "apiserver.crt")); ca != nil {
				cp.caPEM = ca
			} else {
				last = "certs/apiserver.crt not written yet"
			}
		}
		if cp.caPEM != nil {
			body, err := cp.get("/readyz")
			if err == nil && strings.TrimSpace(body) == "ok" {
				return nil
			}
			last = fmt.Sprintf("/readyz: %q %v", body, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (cp *controlPlane) get(path string) (string, error) {
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(cp.caPEM)
	c := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	req, _ := http.NewRequestWithContext(context.Background(), http.MethodGet, cp.server+path, nil)
	req.Header.Set("Authorization", "Bearer "+adminToken)
	resp, err := c.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b := make([]byte, 4096)
	n, _ := resp.Body.Read(b)
	return string(b[:n]), nil
}

// caFromCertFile returns the CA of the apiserver's self-signed certificate: the second PEM block
// of apiserver.crt (leaf first), nil until the file is complete.
func caFromCertFile(path string) []byte {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil
	}
	var blocks [][]byte
	for {
		var b *pem.Block
		b, raw = pem.Decode(raw)
		if b == nil {
			break
		}
		blocks = append(blocks, pem.EncodeToMemory(b))
	}
	if len(blocks) < 2 {
		return nil
	}
	return blocks[1]
}

func (cp *controlPlane) restConfig() *rest.Config {
	return &rest.Config{
		Host:            cp.server,
		BearerToken:     adminToken,
		TLSClientConfig: rest.TLSClientConfig{CAData: cp.caPEM},
		UserAgent:       userAgent,
		Timeout:         10 * time.Second,
	}
}

func (cp *controlPlane) clientset() (*kubernetes.Clientset, error) {
	return kubernetes.NewForConfig(cp.restConfig())
}

// kubeconfig is a self-contained kubeconfig for the agent (CA embedded, bearer token).
func (cp *controlPlane) kubeconfig() string {
	return fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    server: %s
    certificate-authority-data: %s
users:
- name: admin
  user:
    token: %s
contexts:
- name: local
  context:
    cluster: local
    user: admin
current-context: local
`, cp.server, b64(cp.caPEM), adminToken)
}

func (cp *controlPlane) kill() {
	killProc(cp.apiserver)
	killProc(cp.etcd)
	cp.apiserver, cp.etcd = nil, nil
}

func (cp *controlPlane) stop() {
	cp.kill()
	_ = os.RemoveAll(cp.dir)
}
