//! The float16 GEMM on cooperative matrices: C = A B with A, B float16
//! and C float32, row-major, generated as WGSL text per configuration.
//!
//! Design. A workgroup of SG_M x SG_N subgroups of 32 lanes owns a
//! BM x BN block of C; each subgroup owns FM x FN 16x16 blocks of it, held
//! as named float32 accumulators (`c_<i>_<j>`, 8 registers a lane each on
//! NVIDIA), and multiplies 16x16x16 products into them: per k-step of 16,
//! FM A fragments and FN B fragments feed FM * FN `coopMultiplyAdd`s. The
//! accumulators are carried across the whole K loop: starting each tile's
//! products from zero and adding them in (what paid in flashport's
//! attention kernels) measured several times slower here on the H100 (16
//! TFLOP/s against 65-78 for its neighbours in one process).
//!
//! Staging: tiles of A (BM x BK) and B (BK x BN) go through workgroup
//! memory, double-buffered, rows padded by 8 halves (16 bytes): the 16 rows
//! of a fragment then start in distinct 16-byte bank groups, and every
//! fragment pointer and stride stays a multiple of 16 bytes, which
//! cooperative loads require (VUID-RuntimeSpirv-OpCooperativeMatrixLoadKHR-08986;
//! flashport's first cooperative kernel gave wrong results on the H100 from
//! a misaligned workgroup variable). The next tile is loaded from global
//! memory (16 bytes a load, as vec4<u32>) into registers before the current
//! tile's products and stored to the other buffer after them; one barrier
//! per tile.
//!
//! The element type of the workgroup arrays decides how many stores the
//! staging costs: `Halves` (f16) needs eight scalar stores per 16 bytes.
//! SPV_KHR_cooperative_matrix lets a cooperative load read through a
//! pointer to a wider type than the matrix's components ("to efficiently
//! load matrix data into shared memory, which can be declared to use a
//! larger type (e.g. uvec4)"; the stride is then in those elements), so
//! `Quads` (vec4<f16>) stages with two stores. On the H100 (driver 580)
//! `Quads` led `Halves` by 1-7%; u32 arrays (four stores) did not compile
//! there ("NVVM compilation failed"), and cooperative loads straight from
//! the storage buffers, without staging, reached a third of the best
//! staged kernel.

use std::fmt::Write;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Staging {
    /// Workgroup arrays of f16.
    Halves,
    /// Workgroup arrays of vec4<f16>.
    Quads,
}

impl Staging {
    /// Halves per element of the workgroup arrays.
    fn unit(self) -> u32 {
        match self {
            Staging::Halves => 1,
            Staging::Quads => 4,
        }
    }

    fn wgsl_type(self) -> &'static str {
        match self {
            Staging::Halves => "f16",
            Staging::Quads => "vec4<f16>",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CoopConfig {
    pub sg_m: u32,
    pub sg_n: u32,
    /// 16x16 blocks per subgroup along M and N.
    pub fm: u32,
    pub fn_: u32,
    /// K per tile (a multiple of 16).
    pub bk: u32,
    pub staging: Staging,
}

const fn cfg(
    (sg_m, sg_n): (u32, u32),
    (fm, fn_): (u32, u32),
    bk: u32,
    staging: Staging,
) -> CoopConfig {
    CoopConfig {
        sg_m,
        sg_n,
        fm,
        fn_,
        bk,
        staging,
    }
}

/// The sweep, most promising first (`--quick` runs the first two). On the
/// H100 (driver 580, 4096^3) 8 subgroups of 4x4 blocks staged as vec4<f16>
/// led (204-210 TFLOP/s; 189-190 for 128x128 tiles, 168 for 4 subgroups);
/// not swept: fragments loaded from global memory instead of staged (69),
/// u32 staging (did not compile), and 128x256x32 with one staging buffer
/// and two barriers a tile (its process was still running after 400 s).
pub const CONFIGS: &[CoopConfig] = &[
    cfg((2, 4), (4, 4), 16, Staging::Quads),
    cfg((4, 2), (4, 4), 16, Staging::Quads),
    cfg((2, 4), (4, 2), 32, Staging::Quads),
    cfg((4, 2), (2, 4), 32, Staging::Quads),
    cfg((4, 4), (2, 2), 32, Staging::Quads),
    cfg((2, 2), (4, 4), 32, Staging::Quads),
    cfg((2, 4), (4, 4), 16, Staging::Halves),
];

impl CoopConfig {
    pub fn threads(&self) -> u32 {
        32 * self.sg_m * self.sg_n
    }

    pub fn bm(&self) -> u32 {
        16 * self.fm * self.sg_m
    }

    pub fn bn(&self) -> u32 {
        16 * self.fn_ * self.sg_n
    }

    /// Halves per global load while staging (a vec4<u32>).
    const CHUNK: u32 = 8;

    /// Row strides of the staged tiles, in halves.
    fn a_stride(&self) -> u32 {
        self.bk + 8
    }

    fn b_stride(&self) -> u32 {
        self.bn() + 8
    }

    fn a_loads(&self) -> u32 {
        self.bm() * self.bk / Self::CHUNK / self.threads()
    }

    fn b_loads(&self) -> u32 {
        self.bk * self.bn() / Self::CHUNK / self.threads()
    }

    pub fn workgroup_bytes(&self) -> u32 {
        2 * 2 * (self.bm() * self.a_stride() + self.bk * self.b_stride())
    }

    pub fn well_formed(&self) -> bool {
        let n = self.threads();
        self.bk % 16 == 0
            && self.fm > 0
            && self.fn_ > 0
            && (self.bm() * self.bk / Self::CHUNK) % n == 0
            && (self.bk * self.bn() / Self::CHUNK) % n == 0
            && self.a_loads() > 0
            && self.b_loads() > 0
    }

    pub fn name(&self) -> String {
        format!(
            "f16 coop {}x{}x{} tile, {}x{} subgroups of {}x{} blocks, staged as {}",
            self.bm(),
            self.bn(),
            self.bk,
            self.sg_m,
            self.sg_n,
            self.fm,
            self.fn_,
            self.staging.wgsl_type(),
        )
    }

    pub fn wgsl(&self) -> String {
        let CoopConfig {
            sg_n,
            fm,
            fn_,
            bk,
            staging,
            ..
        } = *self;
        let nt = self.threads();
        let (bm, bn) = (self.bm(), self.bn());
        // Strides and offsets of the staged tiles are in elements of the
        // workgroup arrays (`u` halves each).
        let u = staging.unit();
        let (as_, bs) = (self.a_stride() / u, self.b_stride() / u);
        let mut s = String::new();
        let w = &mut s;
        wl(w, "enable f16;");
        wl(w, "enable wgpu_cooperative_matrix;");
        wl(
            w,
            &format!("// Generated by flashport-gemm-ceiling: {}.", self.name()),
        );
        wl(w, "alias A16 = coop_mat16x16<f16, A>;");
        wl(w, "alias B16 = coop_mat16x16<f16, B>;");
        wl(w, "alias C32 = coop_mat16x16<f32, C>;");
        // vec4<u32>: 16-byte loads, and no f16 storage-buffer access.
        wl(
            w,
            "@group(0) @binding(0) var<storage, read> a: array<vec4<u32>>;",
        );
        wl(
            w,
            "@group(0) @binding(1) var<storage, read> b: array<vec4<u32>>;",
        );
        wl(
            w,
            "@group(0) @binding(2) var<storage, read_write> c: array<f32>;",
        );
        wl(w, "// (M, N, K, 0)");
        wl(w, "@group(0) @binding(3) var<uniform> dims: vec4<u32>;");
        let ty = staging.wgsl_type();
        wl(
            w,
            &format!("var<workgroup> sa: array<{ty}, {}>;", 2 * bm * as_),
        );
        wl(
            w,
            &format!("var<workgroup> sb: array<{ty}, {}>;", 2 * bk * bs),
        );
        wl(w, "");
        wl(w, &format!("@compute @workgroup_size({nt})"));
        wl(w, "fn main(");
        wl(w, "    @builtin(workgroup_id) wid: vec3<u32>,");
        wl(w, "    @builtin(local_invocation_index) lid: u32,");
        wl(w, "    @builtin(subgroup_id) sg: u32,");
        wl(w, ") {");
        wl(w, "    let n = dims.y;");
        wl(w, "    let k = dims.z;");
        wl(w, &format!("    let tiles = k / {bk}u;"));
        wl(w, &format!("    let m0 = wid.y * {bm}u;"));
        wl(w, &format!("    let n0 = wid.x * {bn}u;"));
        // This subgroup's first row and column of C.
        wl(
            w,
            &format!("    let sm = m0 + (sg / {sg_n}u) * {}u;", 16 * fm),
        );
        wl(
            w,
            &format!("    let sn = n0 + (sg % {sg_n}u) * {}u;", 16 * fn_),
        );
        self.staging_setup(w);
        for i in 0..fm {
            for j in 0..fn_ {
                wl(w, &format!("    var c_{i}_{j} = C32();"));
            }
        }
        wl(w, "    for (var t = 0u; t < tiles; t++) {");
        // The last tile reloads itself: a branch-free body; the store it
        // feeds goes to the buffer nobody reads any more.
        wl(w, "        let tn = min(t + 1u, tiles - 1u);");
        self.global_loads(w, "tn");
        wl(
            w,
            &format!(
                "        let ab = (t & 1u) * {}u + (sm - m0) * {as_}u;",
                bm * as_
            ),
        );
        wl(
            w,
            &format!(
                "        let bb = (t & 1u) * {}u + (sn - n0) / {u}u;",
                bk * bs
            ),
        );
        for kk in 0..bk / 16 {
            for i in 0..fm {
                let ptr = format!("&sa[ab + {}u], {as_}u", 16 * i * as_ + 16 * kk / u);
                wl(
                    w,
                    &format!("        let fa{i}_{kk} = coopLoadT<A16>({ptr});"),
                );
            }
            for j in 0..fn_ {
                let ptr = format!("&sb[bb + {}u], {bs}u", 16 * kk * bs + 16 * j / u);
                wl(
                    w,
                    &format!("        let fb{j}_{kk} = coopLoadT<B16>({ptr});"),
                );
            }
            for i in 0..fm {
                for j in 0..fn_ {
                    wl(
                        w,
                        &format!(
                            "        c_{i}_{j} = coopMultiplyAdd(fa{i}_{kk}, fb{j}_{kk}, c_{i}_{j});"
                        ),
                    );
                }
            }
        }
        self.staging_store(w, "((t + 1u) & 1u)");
        wl(w, "        workgroupBarrier();");
        wl(w, "    }");
        // The offsets are `let`s because naga 30's WGSL front end pushes
        // a cooperative store before emitting the expressions of its
        // arguments: an index computed inline would be used before it is
        // defined (naga's SPIR-V writer panics on it).
        for i in 0..fm {
            for j in 0..fn_ {
                wl(
                    w,
                    &format!(
                        "    let at_{i}_{j} = (sm + {}u) * n + sn + {}u;",
                        16 * i,
                        16 * j
                    ),
                );
                wl(w, &format!("    coopStoreT(c_{i}_{j}, &c[at_{i}_{j}], n);"));
            }
        }
        wl(w, "}");
        s
    }

    /// Where each invocation's staging loads come from and go to, the first
    /// tile's loads, their store to buffer 0 and the barrier after it.
    /// Load i of an invocation is 16-byte chunk i * threads + lid of the
    /// tile, row-major: consecutive lanes read consecutive chunks.
    fn staging_setup(&self, w: &mut String) {
        let nt = self.threads();
        let cw = Self::CHUNK;
        let u = self.staging.unit();
        let (aq, bq) = (self.bk / cw, self.bn() / cw);
        wl(w, &format!("    let kc = k / {cw}u;"));
        wl(w, &format!("    let nc = n / {cw}u;"));
        for i in 0..self.a_loads() {
            wl(w, &format!("    let ar{i} = ({}u + lid) / {aq}u;", i * nt));
            wl(w, &format!("    let aq{i} = ({}u + lid) % {aq}u;", i * nt));
            wl(w, &format!("    let ag{i} = (m0 + ar{i}) * kc + aq{i};"));
            wl(
                w,
                &format!(
                    "    let as{i} = ar{i} * {}u + aq{i} * {}u;",
                    self.a_stride() / u,
                    cw / u
                ),
            );
        }
        for i in 0..self.b_loads() {
            wl(w, &format!("    let br{i} = ({}u + lid) / {bq}u;", i * nt));
            wl(w, &format!("    let bq{i} = ({}u + lid) % {bq}u;", i * nt));
            wl(
                w,
                &format!("    let bg{i} = br{i} * nc + n0 / {cw}u + bq{i};"),
            );
            wl(
                w,
                &format!(
                    "    let bs{i} = br{i} * {}u + bq{i} * {}u;",
                    self.b_stride() / u,
                    cw / u
                ),
            );
        }
        for i in 0..self.a_loads() {
            wl(w, &format!("    var ra{i} = a[ag{i}];"));
        }
        for i in 0..self.b_loads() {
            wl(w, &format!("    var rb{i} = b[bg{i}];"));
        }
        self.staging_store(w, "0u");
        wl(w, "    workgroupBarrier();");
    }

    /// Loads tile `tile` (a WGSL expression) into the staging registers.
    fn global_loads(&self, w: &mut String, tile: &str) {
        let cw = Self::CHUNK;
        for i in 0..self.a_loads() {
            wl(
                w,
                &format!("        ra{i} = a[ag{i} + {tile} * {}u];", self.bk / cw),
            );
        }
        for i in 0..self.b_loads() {
            wl(
                w,
                &format!("        rb{i} = b[bg{i} + {tile} * {}u * nc];", self.bk),
            );
        }
    }

    /// Stores the staging registers to buffer `buf` (a WGSL expression
    /// worth 0 or 1).
    fn staging_store(&self, w: &mut String, buf: &str) {
        let u = self.staging.unit();
        let a_buf = self.bm() * self.a_stride() / u;
        let b_buf = self.bk * self.b_stride() / u;
        wl(w, "    {");
        wl(w, &format!("        let sab = {buf} * {a_buf}u;"));
        wl(w, &format!("        let sbb = {buf} * {b_buf}u;"));
        let regs = (0..self.a_loads())
            .map(|i| ("sa", "sab", format!("ra{i}"), format!("as{i}")))
            .chain((0..self.b_loads()).map(|i| ("sb", "sbb", format!("rb{i}"), format!("bs{i}"))));
        const COMPS: [&str; 4] = ["x", "y", "z", "w"];
        for (array, base, reg, at) in regs {
            let to = |e: u32| format!("        {array}[{base} + {at} + {e}u]");
            // unpack2x16float: the low half is .x, the element at the lower
            // address.
            match self.staging {
                Staging::Quads => {
                    for q in 0..2 {
                        let (lo, hi) = (COMPS[2 * q], COMPS[2 * q + 1]);
                        wl(
                            w,
                            &format!(
                                "{} = vec4<f16>(vec4<f32>(unpack2x16float({reg}.{lo}), \
                                 unpack2x16float({reg}.{hi})));",
                                to(q as u32)
                            ),
                        );
                    }
                }
                Staging::Halves => {
                    for (p, comp) in COMPS.iter().enumerate() {
                        let h = format!("h_{reg}_{p}");
                        let p = p as u32;
                        wl(
                            w,
                            &format!("        let {h} = unpack2x16float({reg}.{comp});"),
                        );
                        wl(w, &format!("{} = f16({h}.x);", to(2 * p)));
                        wl(w, &format!("{} = f16({h}.y);", to(2 * p + 1)));
                    }
                }
            }
        }
        wl(w, "    }");
    }
}

fn wl(w: &mut String, line: &str) {
    let _ = writeln!(w, "{line}");
}
