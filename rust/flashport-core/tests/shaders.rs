//! Every WGSL file under `shaders/` parses and validates with naga (the
//! compiler wgpu uses), with no GPU: a broken shader fails here with a
//! readable message instead of at pipeline creation on some user's machine.
//! The kernels are also specialised with the override values the host
//! passes for a few head dimensions, as pipeline creation does.

use std::path::PathBuf;

use flashport_core::gpu::kernel::{Kernel, Pass, Tier};
use flashport_core::gpu::select::AdapterCaps;
use flashport_core::gpu::shaders::{
    decode_coop_source, decode_source, decode_subgroup_source, score_variant_overrides, source,
    tile_overrides, variant_overrides, Variants, DECODE_COMBINE, DECODE_COMBINE_F16, DEVICE_ARRAYS,
    KV_SCATTER, MERGE_STATES, SCREEN, VARLEN,
};
use flashport_core::gpu::tiles::{
    coop_backward_tiles, coop_forward_candidates, coop_forward_tiles, coop_workgroup_bytes,
    simple_tiles, tiled_backward_tiles, tiled_forward_tiles, workgroup_bytes, Tiles,
};
use wgpu::naga;

/// The forward kernel the backend selects for float32 inputs without
/// variants: the tiled one where its tiles fit, else the simple one.
fn forward_kernel(d: u32, dv: u32, caps: AdapterCaps) -> (Kernel, Tiles) {
    match tiled_forward_tiles(d, dv, caps) {
        Some(t) => (Kernel::forward(Tier::Tiled), t),
        None => (
            Kernel::forward(Tier::Simple),
            simple_tiles(Kernel::forward(Tier::Simple), d, dv, caps),
        ),
    }
}

fn shader_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shaders")
}

fn validator() -> naga::valid::Validator {
    // What the kernels need beyond WebGPU's core: only unpack2x16float
    // (float16 inputs), which every WebGPU-compliant adapter has.
    naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::SHADER_FLOAT16_IN_FLOAT32,
    )
}

/// With subgroup operations, which the tiled forward's subgroup variant
/// needs (requested only where the adapter offers them).
fn subgroup_validator() -> naga::valid::Validator {
    let mut v = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::SHADER_FLOAT16_IN_FLOAT32 | naga::valid::Capabilities::SUBGROUP,
    );
    v.subgroup_stages(naga::valid::ShaderStages::COMPUTE);
    v.subgroup_operations(naga::valid::SubgroupOperationSet::all());
    v
}

fn parse_text(name: &str, source: &str) -> naga::Module {
    naga::front::wgsl::parse_str(source)
        .unwrap_or_else(|e| panic!("{name} does not parse:\n{}", e.emit_to_string(source)))
}

/// The tiled forward is assembled from shaders/tiled/forward.wgsl and a row
/// reduction fragment (shaders/lib/row_reduce_*.wgsl); both variants must
/// validate and specialise for the tiles the host picks, on small and large
/// adapters.
#[test]
fn tiled_forward_variants_validate_and_specialise() {
    let nvidia = AdapterCaps {
        workgroup_storage_bytes: 48 * 1024,
        max_invocations: 1024,
        max_workgroup_size_x: 1024,
        subgroups: true,
        ..AdapterCaps::WEBGPU_DEFAULT
    };
    let lavapipe = AdapterCaps {
        workgroup_storage_bytes: 32 * 1024,
        max_invocations: 1024,
        max_workgroup_size_x: 1024,
        subgroups: true,
        ..AdapterCaps::WEBGPU_DEFAULT
    };
    for (subgroups, f16) in [(false, false), (true, false), (false, true), (true, true)] {
        let text = source(Kernel::forward(Tier::Tiled), subgroups, f16);
        let name = format!("forward_tiled (subgroups={subgroups}, f16 inputs={f16})");
        let module = parse_text(&name, &text);
        let info = subgroup_validator()
            .validate(&module)
            .unwrap_or_else(|e| panic!("{name} does not validate:\n{}", e.emit_to_string(&text)));
        for base in [nvidia, lavapipe, AdapterCaps::WEBGPU_DEFAULT] {
            let caps = AdapterCaps { subgroups, ..base };
            for (d, dv) in [(64, 64), (128, 128), (4, 4), (256, 8), (16, 24), (60, 36)] {
                let (kernel, t) = forward_kernel(d, dv, caps);
                if kernel != Kernel::forward(Tier::Tiled) {
                    continue;
                }
                let mut constants: naga::back::PipelineConstants = Default::default();
                for (k, v) in tile_overrides(kernel, f16, d, dv, t, subgroups) {
                    constants.insert(k.to_string(), v);
                }
                let result = naga::back::pipeline_constants::process_overrides(
                    &module,
                    &info,
                    Some((naga::ShaderStage::Compute, "main")),
                    &constants,
                );
                if let Err(e) = result {
                    panic!("{name} d={d} dv={dv} {t:?}: {e:?}");
                }
            }
        }
    }
}

const EVERY_KERNEL: [Kernel; 7] = [
    Kernel::forward(Tier::Simple),
    Kernel::PREPROCESS,
    Kernel::dkdv(Tier::Simple),
    Kernel::dq(Tier::Simple),
    Kernel::forward(Tier::Tiled),
    Kernel::dq(Tier::Tiled),
    Kernel::dkdv(Tier::Tiled),
];

/// The ten kernels: the seven above and the three cooperative ones.
fn all_kernels() -> impl Iterator<Item = Kernel> {
    EVERY_KERNEL.into_iter().chain([
        Kernel::forward(Tier::Coop),
        Kernel::dq(Tier::Coop),
        Kernel::dkdv(Tier::Coop),
    ])
}

/// Every WGSL file under `shaders/`, relative to it, sorted.
fn shader_files() -> Vec<String> {
    fn walk(dir: &std::path::Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "wgsl") {
                out.push(path);
            }
        }
    }
    let mut files = Vec::new();
    walk(&shader_dir(), &mut files);
    let mut names: Vec<String> = files
        .iter()
        .map(|p| {
            let rel = p.strip_prefix(shader_dir()).unwrap();
            rel.to_str().unwrap().replace('\\', "/")
        })
        .collect();
    names.sort();
    names
}

/// The kernel of a file in a tier's folder: shaders/simple/forward.wgsl is
/// the simple forward, shaders/tiled/forward.wgsl the tiled one.
fn kernel_of(file: &str) -> Option<Kernel> {
    let (tier, name) = file.strip_suffix(".wgsl")?.split_once('/')?;
    let suffix = match tier {
        "simple" => "",
        "tiled" => "_tiled",
        "coop" => "_coop",
        _ => return None,
    };
    all_kernels().find(|k| k.name() == format!("{name}{suffix}"))
}

#[test]
fn every_shader_parses_and_validates() {
    let files = shader_files();
    let kernels: Vec<&String> = files.iter().filter(|f| kernel_of(f).is_some()).collect();
    assert_eq!(
        kernels.len(),
        10,
        "expected the kernels in {:?}",
        shader_dir()
    );
    for file in &files {
        if file.starts_with("lib/") {
            // A fragment is checked as part of the kernels that take it.
            let text = std::fs::read_to_string(shader_dir().join(file)).unwrap();
            let modules = [
                MERGE_STATES.to_string(),
                DECODE_COMBINE.to_string(),
                DECODE_COMBINE_F16.to_string(),
                DEVICE_ARRAYS.to_string(),
                KV_SCATTER.to_string(),
                SCREEN.to_string(),
                decode_source(false, true),
                decode_source(true, false),
            ];
            let taken = all_kernels()
                .flat_map(|k| [(k, false), (k, true)])
                .any(|(k, sub)| {
                    [false, true]
                        .iter()
                        .any(|&f16| source(k, sub, f16).contains(&text))
                })
                || modules.iter().any(|m| m.contains(&text));
            assert!(taken, "shaders/{file} is a fragment no kernel takes");
            continue;
        }
        if [
            "device_arrays.wgsl",
            "kv_scatter.wgsl",
            "merge_states.wgsl",
            "screen.wgsl",
            "varlen.wgsl",
        ]
        .contains(&file.as_str())
            || file.starts_with("decode/")
        {
            // Stand-alone modules, checked below.
            continue;
        }
        let kernel =
            kernel_of(file).unwrap_or_else(|| panic!("shaders/{file} is no kernel the host knows"));
        if kernel.is_coop() {
            // They need their own capabilities (below).
            continue;
        }
        // The kernels are valid as the host assembles them (the tiled
        // forward is checked with both of its row reductions in
        // tiled_forward_variants_validate_and_specialise).
        for f16 in [false, true] {
            let text = source(kernel, false, f16);
            let module = parse_text(file, &text);
            if let Err(e) = validator().validate(&module) {
                panic!(
                    "shaders/{file} (f16 inputs={f16}) does not validate:\n{}",
                    e.emit_to_string(&text)
                );
            }
        }
    }
}

/// A module of its own (no kernel's fragments) validates with WebGPU's
/// core capabilities as it is, with the entry points the host runs.
fn module_validates(file: &str, text: &str, entries: &[&str]) {
    let module = parse_text(file, text);
    let plain =
        naga::valid::Validator::new(naga::valid::ValidationFlags::all(), Default::default())
            .validate(&module);
    if let Err(e) = plain {
        panic!("{file} does not validate:\n{}", e.emit_to_string(text));
    }
    let mut found: Vec<&str> = module
        .entry_points
        .iter()
        .map(|e| e.name.as_str())
        .collect();
    found.sort();
    assert_eq!(found, entries);
}

/// The screen in front of the fast attention kernels (src/gpu/screen.rs):
/// a module of its own, whose override only picks the element type.
#[test]
fn screen_validates() {
    module_validates("screen.wgsl", SCREEN, &["main"]);
}

/// The device-array moves (copies, sums, float16 rounding between a
/// DeviceArray and the kernels' buffers) are one module of their own, with
/// no overrides: it must validate with WebGPU's core capabilities.
#[test]
fn device_array_moves_validate() {
    module_validates(
        "device_arrays.wgsl",
        DEVICE_ARRAYS,
        &["add_f32", "copy_f16", "to_f16"],
    );
}

/// A KV cache's scatter (writes and block copies into its pools) is a
/// module of its own, with no overrides: it must validate with WebGPU's
/// core capabilities, with the two entry points the host runs.
#[test]
fn kv_scatter_validates() {
    module_validates(
        "kv_scatter.wgsl",
        KV_SCATTER,
        &["scatter_f16", "scatter_f32"],
    );
}

/// The merge of attention states is a module of its own, with no
/// overrides and no capabilities beyond WebGPU's core (float16 parts are
/// widened on the bits): it must validate as it is, with the four entry
/// points the host runs.
#[test]
fn merge_states_validates() {
    module_validates(
        "merge_states.wgsl",
        MERGE_STATES,
        &["merge_accumulate", "merge_finish", "merge_max", "merge_sum"],
    );
}

/// attention_varlen's moves between the packed and the head-major layout
/// are a module of their own with WebGPU's core capabilities, like the
/// device-array moves.
#[test]
fn varlen_moves_validate() {
    module_validates(
        "varlen.wgsl",
        VARLEN,
        &["varlen_swap_f16", "varlen_swap_f32"],
    );
}

/// Every kernel binds at most 8 storage buffers per stage, WebGPU's default
/// limit (`wgpu::Limits::default()`), so that no adapter is refused for it.
#[test]
fn every_kernel_binds_at_most_eight_storage_buffers() {
    for (kernel, f16) in EVERY_KERNEL
        .into_iter()
        .flat_map(|k| [(k, false), (k, true)])
    {
        let text = source(kernel, false, f16);
        let module = parse_text(kernel.name(), &text);
        let storage = module
            .global_variables
            .iter()
            .filter(|(_, g)| matches!(g.space, naga::AddressSpace::Storage { .. }))
            .count();
        assert!(
            storage <= 8,
            "{kernel:?} (f16 inputs={f16}) binds {storage} storage buffers"
        );
    }
}

/// Every kernel specialises with every attention variant switched on (and
/// off, in the tests above).
#[test]
fn kernels_specialise_with_every_variant() {
    let all = Variants {
        softcap: true,
        alibi: true,
        mask: true,
        sinks: true,
        dropout: true,
        window: true,
        dmask: true,
        varlen: true,
        screened: true,
    };
    let caps = AdapterCaps {
        workgroup_storage_bytes: 32 * 1024,
        max_invocations: 1024,
        max_workgroup_size_x: 1024,
        subgroups: false,
        ..AdapterCaps::WEBGPU_DEFAULT
    };
    for (kernel, f16) in EVERY_KERNEL
        .into_iter()
        .flat_map(|k| [(k, false), (k, true)])
    {
        let text = source(kernel, false, f16);
        let module = parse_text(kernel.name(), &text);
        let info = validator().validate(&module).unwrap();
        let (d, dv) = (64, 32);
        let t = match (kernel.pass(), kernel.tier()) {
            (Pass::Forward, Tier::Tiled) => forward_kernel(d, dv, caps).1,
            (Pass::BackwardDq, Tier::Tiled) => tiled_backward_tiles(d, dv, caps).unwrap().0,
            (Pass::BackwardDkDv, Tier::Tiled) => tiled_backward_tiles(d, dv, caps).unwrap().1,
            _ => simple_tiles(kernel, d, dv, caps),
        };
        let mut constants: naga::back::PipelineConstants = Default::default();
        for (k, v) in tile_overrides(kernel, f16, d, dv, t, false)
            .into_iter()
            .chain(variant_overrides(kernel, all))
        {
            constants.insert(k.to_string(), v);
        }
        if let Err(e) = naga::back::pipeline_constants::process_overrides(
            &module,
            &info,
            Some((naga::ShaderStage::Compute, "main")),
            &constants,
        ) {
            panic!("{kernel:?} (f16 inputs={f16}) with every variant: {e:?}");
        }
    }
}

fn overrides(kernel: Kernel, d: u32, dv: u32) -> naga::back::PipelineConstants {
    let t = simple_tiles(kernel, d, dv, AdapterCaps::WEBGPU_DEFAULT);
    let (bq, bk) = (t.q_rows, t.k_rows);
    let n = |x: u32| x.max(1) as f64;
    let mut c: naga::back::PipelineConstants = Default::default();
    let mut set = |name: &str, value: f64| {
        c.insert(name.to_string(), value);
    };
    set("WG", t.workgroup as f64);
    set("DV", dv as f64);
    if kernel != Kernel::PREPROCESS {
        set("BQ", bq as f64);
        set("BK", bk as f64);
        set("D", d as f64);
        set("Q_ELEMS", n(bq * d));
        set("K_ELEMS", n(bk * (d + 1)));
        set("V_ELEMS", n(bk * (dv + 1)));
        set("S_ELEMS", n(bq * bk));
        set("ROW_ELEMS", n(bq));
        if kernel == Kernel::forward(Tier::Simple) {
            set("O_ELEMS", n(bq * dv));
        } else {
            set("DO_ELEMS", n(bq * dv));
        }
    }
    c
}

#[test]
fn kernels_specialise_for_the_host_tiles() {
    for kernel in Kernel::SIMPLE {
        for (d, dv, f16) in [
            (1, 0, false),
            (64, 64, true),
            (256, 256, false),
            (48, 7, true),
        ] {
            let text = source(kernel, false, f16);
            let module = parse_text(kernel.name(), &text);
            let info = validator().validate(&module).unwrap();
            let constants = overrides(kernel, d, dv);
            let result = naga::back::pipeline_constants::process_overrides(
                &module,
                &info,
                Some((naga::ShaderStage::Compute, "main")),
                &constants,
            );
            if let Err(e) = result {
                panic!("{kernel:?} d={d} dv={dv} f16={f16}: {e:?}");
            }
        }
    }
}

/// The tiled backward kernels specialise for the tiles the host picks.
#[test]
fn tiled_backward_kernels_validate_and_specialise() {
    for (kernel, f16) in [Kernel::dq(Tier::Tiled), Kernel::dkdv(Tier::Tiled)]
        .into_iter()
        .flat_map(|k| [(k, false), (k, true)])
    {
        let text = source(kernel, false, f16);
        let name = format!("{} (f16 inputs={f16})", kernel.name());
        let module = parse_text(&name, &text);
        let info = validator()
            .validate(&module)
            .unwrap_or_else(|e| panic!("{name} does not validate:\n{}", e.emit_to_string(&text)));
        for kib in [16, 32, 48] {
            let caps = AdapterCaps {
                workgroup_storage_bytes: kib * 1024,
                max_invocations: 1024,
                max_workgroup_size_x: 1024,
                subgroups: false,
                ..AdapterCaps::WEBGPU_DEFAULT
            };
            for (d, dv) in [(64, 64), (128, 128), (4, 4), (16, 24), (60, 36), (128, 8)] {
                let Some((tq, tkv)) = tiled_backward_tiles(d, dv, caps) else {
                    continue;
                };
                let t = if kernel == Kernel::dq(Tier::Tiled) {
                    tq
                } else {
                    tkv
                };
                let mut constants: naga::back::PipelineConstants = Default::default();
                for (k, v) in tile_overrides(kernel, f16, d, dv, t, false) {
                    constants.insert(k.to_string(), v);
                }
                if let Err(e) = naga::back::pipeline_constants::process_overrides(
                    &module,
                    &info,
                    Some((naga::ShaderStage::Compute, "main")),
                    &constants,
                ) {
                    panic!("{name} d={d} dv={dv} {t:?}: {e:?}");
                }
            }
        }
    }
}

/// The validator with the capabilities the device enables for the
/// cooperative-matrix kernels.
fn coop_validator() -> naga::valid::Validator {
    let mut v = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::SHADER_FLOAT16_IN_FLOAT32
            | naga::valid::Capabilities::SHADER_FLOAT16
            | naga::valid::Capabilities::SUBGROUP
            | naga::valid::Capabilities::SUBGROUP_BARRIER
            | naga::valid::Capabilities::COOPERATIVE_MATRIX,
    );
    v.subgroup_stages(naga::valid::ShaderStages::COMPUTE);
    v.subgroup_operations(naga::valid::SubgroupOperationSet::all());
    v
}

/// The variants of a packed batch (attention_varlen) as `select` keys
/// them: the row table, and rows that start later than key 0.
const PACKED: Variants = Variants {
    softcap: false,
    alibi: false,
    mask: false,
    sinks: false,
    dropout: false,
    window: true,
    dmask: false,
    varlen: true,
    screened: false,
};

const NVIDIA: AdapterCaps = AdapterCaps {
    workgroup_storage_bytes: 48 * 1024,
    max_invocations: 1024,
    max_workgroup_size_x: 1024,
    subgroups: true,
    ..AdapterCaps::WEBGPU_DEFAULT
};

/// The cooperative-matrix forward validates with the capabilities the
/// device enables for it and specialises for the tiles the host picks.
#[test]
fn coop_forward_validates_and_specialises() {
    let text = source(Kernel::forward(Tier::Coop), true, true);
    let module = parse_text("forward_coop", &text);
    let info = coop_validator().validate(&module).unwrap_or_else(|e| {
        panic!(
            "forward_coop does not validate:\n{}",
            e.emit_to_string(&text)
        )
    });
    let nvidia = NVIDIA;
    let mut specialised = 0;
    let mut layouts = std::collections::BTreeSet::new();
    for (d, dv) in [
        (64, 64),
        (128, 128),
        (16, 16),
        (16, 128),
        (128, 16),
        (32, 96),
    ] {
        assert!(
            coop_forward_tiles(d, dv, nvidia).is_some(),
            "no cooperative tiles for d={d} dv={dv}"
        );
        // Every layout the selection may pick.
        for (t, variants) in coop_forward_candidates(d, dv, nvidia)
            .flat_map(|t| [(t, Variants::default()), (t, PACKED)])
        {
            assert!(coop_workgroup_bytes(d, dv, t) <= 48 * 1024);
            layouts.insert((t.workgroup, t.k_rows));
            let mut constants: naga::back::PipelineConstants = Default::default();
            for (k, val) in tile_overrides(Kernel::forward(Tier::Coop), true, d, dv, t, true)
                .into_iter()
                .chain(variant_overrides(Kernel::forward(Tier::Coop), variants))
            {
                constants.insert(k.to_string(), val);
            }
            naga::back::pipeline_constants::process_overrides(
                &module,
                &info,
                Some((naga::ShaderStage::Compute, "main")),
                &constants,
            )
            .unwrap_or_else(|e| panic!("forward_coop d={d} dv={dv} {t:?} {variants:?}: {e:?}"));
            specialised += 1;
        }
    }
    assert!(specialised >= 12, "{specialised}");
    assert!(layouts.len() >= 5, "{layouts:?}");
    // Shapes it does not take.
    for (d, dv) in [(8, 64), (64, 24), (256, 64)] {
        assert_eq!(coop_forward_tiles(d, dv, nvidia), None);
    }
}

/// The cooperative-matrix backward kernels validate and specialise for the
/// tiles the host picks, within 48 KiB, at every head dimension they take.
#[test]
fn coop_backward_validates_and_specialises() {
    let mut specialised = 0;
    for kernel in [Kernel::dq(Tier::Coop), Kernel::dkdv(Tier::Coop)] {
        let text = source(kernel, true, true);
        let module = parse_text(kernel.name(), &text);
        let info = coop_validator().validate(&module).unwrap_or_else(|e| {
            panic!(
                "{} does not validate:\n{}",
                kernel.name(),
                e.emit_to_string(&text)
            )
        });
        for (d, dv) in [
            (64, 64),
            (128, 128),
            (16, 16),
            (16, 128),
            (128, 16),
            (32, 96),
        ] {
            let (tq, tkv) = coop_backward_tiles(d, dv, NVIDIA)
                .unwrap_or_else(|| panic!("no cooperative backward tiles for d={d} dv={dv}"));
            let t = if kernel == Kernel::dq(Tier::Coop) {
                tq
            } else {
                tkv
            };
            assert!(workgroup_bytes(kernel, d, dv, t) <= 48 * 1024);
            for variants in [Variants::default(), PACKED] {
                let mut constants: naga::back::PipelineConstants = Default::default();
                for (k, val) in tile_overrides(kernel, true, d, dv, t, true)
                    .into_iter()
                    .chain(variant_overrides(kernel, variants))
                {
                    constants.insert(k.to_string(), val);
                }
                naga::back::pipeline_constants::process_overrides(
                    &module,
                    &info,
                    Some((naga::ShaderStage::Compute, "main")),
                    &constants,
                )
                .unwrap_or_else(|e| {
                    panic!("{} d={d} dv={dv} {t:?} {variants:?}: {e:?}", kernel.name())
                });
                specialised += 1;
            }
        }
    }
    assert_eq!(specialised, 24);
    // d = 64 takes four subgroups and 32 streamed rows in 48 KiB; d = 128
    // four subgroups and 16 streamed rows.
    let (tq, tkv) = coop_backward_tiles(64, 64, NVIDIA).unwrap();
    assert_eq!(
        (tq.q_rows, tq.k_rows, tkv.k_rows, tkv.q_rows),
        (64, 32, 64, 32)
    );
    let (tq, tkv) = coop_backward_tiles(128, 128, NVIDIA).unwrap();
    assert_eq!(
        (tq.q_rows, tq.k_rows, tkv.k_rows, tkv.q_rows),
        (64, 16, 64, 16)
    );
    for (d, dv) in [(8, 64), (64, 24), (256, 64)] {
        assert_eq!(coop_backward_tiles(d, dv, NVIDIA), None);
    }
}

/// The SPIR-V the cooperative forward is built from (src/gpu/spirv.rs):
/// naga declares the Vulkan memory model for a module with cooperative
/// matrices; the patched module declares GLSL450 and neither the
/// VulkanMemoryModel capability nor its extension, and differs in nothing
/// else. The diagnostic shader compiles the same way.
#[test]
fn coop_spirv_uses_the_glsl450_memory_model() {
    use flashport_core::gpu::spirv::{compile, glsl450_memory_model, memory_model};
    use flashport_core::gpu::tiles::Tiles;
    let t = Tiles {
        q_rows: 64,
        k_rows: 64,
        workgroup: 128,
        kv_shared: false,
        prefetch: 0,
    };
    let constants = tile_overrides(Kernel::forward(Tier::Coop), true, 64, 64, t, true);
    let text = source(Kernel::forward(Tier::Coop), true, true);
    for unchecked in [false, true] {
        let naga_words = compile(&text, &constants, unchecked, false).unwrap().words;
        assert_eq!(memory_model(&naga_words), Some(3), "naga's own: Vulkan");
        let patched = compile(&text, &constants, unchecked, true).unwrap();
        assert_eq!(memory_model(&patched.words), Some(1), "patched: GLSL450");
        assert_eq!(patched.workgroup_size, [128, 1, 1]);
        let bindings: Vec<u32> = patched.bindings.iter().map(|b| b.binding).collect();
        assert_eq!(bindings, [0, 15, 1, 2, 3, 4, 5]);
        // Two instructions fewer: OpCapability VulkanMemoryModel (2 words)
        // and OpExtension "SPV_KHR_vulkan_memory_model" (1 + 7 words).
        assert_eq!(naga_words.len() - patched.words.len(), 2 + 8);
        let (again, changed) = glsl450_memory_model(&naga_words);
        assert!(changed);
        assert_eq!(again, patched.words);
        // The patched module is already GLSL450: nothing to change.
        assert!(!glsl450_memory_model(&patched.words).1);
    }
    let diag = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/gpu/coop_diagnostic.wgsl"),
    )
    .unwrap();
    let words = compile(&diag, &[], false, true).unwrap().words;
    assert_eq!(memory_model(&words), Some(1));
}

/// The cooperative backward kernels wait on subgroup barriers around each
/// subgroup's own scratch rows (lib/coop.wgsl,
/// SUBGROUP_SCRATCH); in the SPIR-V they are built from, those barriers
/// order workgroup memory (AcquireRelease | WorkgroupMemory), not naga's
/// SubgroupMemory, which Vulkan ignores.
#[test]
fn coop_backward_subgroup_barriers_order_workgroup_memory() {
    use flashport_core::gpu::spirv::{
        compile, subgroup_barrier_semantics, subgroup_barriers_order_workgroup_memory,
        SEMANTICS_WORKGROUP_MEMORY,
    };
    let nvidia = NVIDIA;
    let (tq, tkv) = coop_backward_tiles(64, 64, nvidia).unwrap();
    for (kernel, t) in [
        (Kernel::dq(Tier::Coop), tq),
        (Kernel::dkdv(Tier::Coop), tkv),
    ] {
        let constants = tile_overrides(kernel, true, 64, 64, t, true);
        let text = source(kernel, true, true);
        let words = compile(&text, &constants, true, true).unwrap().words;
        // One barrier instruction: naga keeps scratch_barrier() a function.
        assert_eq!(
            subgroup_barrier_semantics(&words),
            [SEMANTICS_WORKGROUP_MEMORY],
            "{}",
            kernel.name()
        );
        // Already patched: the same words again.
        assert_eq!(subgroup_barriers_order_workgroup_memory(&words).0, words);
    }
    // A module without a workgroup barrier has no such constant yet: it is
    // declared (the id bound grows by one) and the barrier uses it.
    let text = "@compute @workgroup_size(32) fn main() { subgroupBarrier(); }";
    let words = compile(text, &[], false, true).unwrap().words;
    assert_eq!(
        subgroup_barrier_semantics(&words),
        [SEMANTICS_WORKGROUP_MEMORY]
    );
    // The forward has no subgroup barrier: unchanged.
    let t = coop_forward_tiles(64, 64, nvidia).unwrap();
    let constants = tile_overrides(Kernel::forward(Tier::Coop), true, 64, 64, t, true);
    let words = compile(
        &source(Kernel::forward(Tier::Coop), true, true),
        &constants,
        true,
        true,
    )
    .unwrap()
    .words;
    assert!(subgroup_barrier_semantics(&words).is_empty());
    assert_eq!(subgroup_barriers_order_workgroup_memory(&words).1, 0);
}

/// The decode kernel (shaders/decode/, with its input and cache-load
/// fragments) validates and specialises for the layouts the host picks on
/// small and large adapters, every variant on and off; the combine pass
/// is a module of its own with WebGPU's core capabilities.
#[test]
fn decode_kernels_validate_and_specialise() {
    use flashport_core::gpu::decode::select::{decode_tiles, AdapterKind, DecodeCaps};
    let adapters = [
        (AdapterKind::Discrete, 48 * 1024, 1024),
        (AdapterKind::Software, 32 * 1024, 1024),
        (AdapterKind::Other, 16 * 1024, 256),
    ];
    for (f16, vec4) in [(false, true), (false, false), (true, true), (true, false)] {
        let text = decode_source(f16, vec4);
        let name = format!("decode (f16={f16}, vec4={vec4})");
        let module = parse_text(&name, &text);
        let info = validator()
            .validate(&module)
            .unwrap_or_else(|e| panic!("{name} does not validate:\n{}", e.emit_to_string(&text)));
        let storage = module
            .global_variables
            .iter()
            .filter(|(_, g)| matches!(g.space, naga::AddressSpace::Storage { .. }))
            .count();
        assert!(storage <= 8, "{name} binds {storage} storage buffers");
        for (kind, bytes, invocations) in adapters {
            let caps = DecodeCaps {
                kind,
                workgroup_storage_bytes: bytes,
                max_invocations: invocations,
                loop_limit: None,
                subgroup_size: None,
                coop: false,
            };
            for (d, dv, rows) in [
                (128, 128, 4),
                (64, 32, 1),
                (256, 256, 8),
                (7, 5, 3),
                (512, 12, 64),
            ] {
                let t = decode_tiles(d, dv, rows, caps).unwrap();
                if t.vec4 != vec4 {
                    continue;
                }
                for variants in [false, true] {
                    let constants: naga::back::PipelineConstants = t
                        .overrides(variants)
                        .into_iter()
                        .chain(score_variant_overrides(variants, variants))
                        .map(|(n, v)| (n.to_string(), v))
                        .collect();
                    if let Err(e) = naga::back::pipeline_constants::process_overrides(
                        &module,
                        &info,
                        Some((naga::ShaderStage::Compute, "main")),
                        &constants,
                    ) {
                        panic!("{name} {t:?}: {e:?}");
                    }
                }
            }
        }
    }
    for text in [DECODE_COMBINE, DECODE_COMBINE_F16] {
        let module = parse_text("decode/combine.wgsl", text);
        let plain =
            naga::valid::Validator::new(naga::valid::ValidationFlags::all(), Default::default())
                .validate(&module);
        if let Err(e) = plain {
            panic!(
                "decode/combine.wgsl does not validate:\n{}",
                e.emit_to_string(text)
            );
        }
    }
}

/// Decoding's subgroup kernel (shaders/decode/subgroup.wgsl, generated)
/// validates with subgroup operations and specialises for the layouts the
/// host picks on subgroups of 8, 32 and 64 lanes, every variant on and off,
/// both key counts per pass, narrower walkers.
#[test]
fn decode_subgroup_kernel_validates_and_specialises() {
    use flashport_core::gpu::decode::select::{
        subgroup_tiles, AdapterKind, DecodeCaps, SubgroupKnobs,
    };
    let adapters = [
        (AdapterKind::Discrete, 48 * 1024, 1024, 32),
        (AdapterKind::Software, 32 * 1024, 1024, 8),
        (AdapterKind::Other, 64 * 1024, 1024, 64),
    ];
    let mut specialised = 0;
    for (f16, vec4) in [(false, true), (false, false), (true, true), (true, false)] {
        let text = decode_subgroup_source(f16, vec4);
        let name = format!("decode/subgroup.wgsl (f16={f16}, vec4={vec4})");
        let module = parse_text(&name, &text);
        let info = subgroup_validator()
            .validate(&module)
            .unwrap_or_else(|e| panic!("{name} does not validate:\n{}", e.emit_to_string(&text)));
        for (kind, bytes, invocations, subgroup) in adapters {
            let caps = DecodeCaps {
                kind,
                workgroup_storage_bytes: bytes,
                max_invocations: invocations,
                loop_limit: None,
                subgroup_size: Some(subgroup),
                coop: false,
            };
            for (d, dv, rows) in [
                (128, 128, 4),
                (64, 32, 1),
                (256, 256, 8),
                (7, 5, 3),
                (512, 12, 64),
                (16, 16, 2),
                (2, 2, 8),
                (8, 8, 8),
                (24, 40, 2),
                (96, 72, 4),
            ] {
                for (keys, lanes, prefetch) in [
                    (4, None, None),
                    (8, None, Some(true)),
                    (4, Some(8), Some(false)),
                    (8, Some(16), None),
                    (4, None, Some(true)),
                ] {
                    let knobs = SubgroupKnobs {
                        keys: Some(keys),
                        lanes,
                        prefetch,
                        ..SubgroupKnobs::default()
                    };
                    let Some(t) = subgroup_tiles(d, dv, rows, f16, caps, knobs) else {
                        continue;
                    };
                    if t.vec4 != vec4 {
                        continue;
                    }
                    for variants in [false, true] {
                        let mut constants: naga::back::PipelineConstants = t
                            .overrides(variants)
                            .into_iter()
                            .chain(score_variant_overrides(variants, variants))
                            .map(|(n, v)| (n.to_string(), v))
                            .collect();
                        constants.insert("SKIPS".to_string(), if variants { 1.0 } else { 0.0 });
                        if let Err(e) = naga::back::pipeline_constants::process_overrides(
                            &module,
                            &info,
                            Some((naga::ShaderStage::Compute, "main")),
                            &constants,
                        ) {
                            panic!("{name} {t:?}: {e:?}");
                        }
                        specialised += 1;
                    }
                }
            }
        }
    }
    assert!(specialised >= 40, "{specialised}");
}

/// Decoding's cooperative kernel validates with the capabilities the
/// device enables for it, specialises for every layout the host picks
/// (paged or not, with the variants and a pool over several buffers), and
/// compiles to SPIR-V with the GLSL450 memory model as the passthrough
/// builds it.
#[test]
fn decode_coop_kernel_validates_and_specialises() {
    use flashport_core::gpu::decode::select::{
        coop_decode_tiles, AdapterKind, DecodeCaps, COOP_MAX_HEAD_DIM,
    };
    let text = decode_coop_source();
    let module = parse_text("decode/coop.wgsl", &text);
    let info = coop_validator().validate(&module).unwrap_or_else(|e| {
        panic!(
            "decode/coop.wgsl does not validate:\n{}",
            e.emit_to_string(&text)
        )
    });
    let caps = DecodeCaps {
        kind: AdapterKind::Discrete,
        workgroup_storage_bytes: 48 * 1024,
        max_invocations: 1024,
        loop_limit: None,
        subgroup_size: Some(32),
        coop: true,
    };
    let mut specialised = 0;
    for (d, dv) in [
        (128, 128),
        (64, 64),
        (16, 16),
        (16, 128),
        (128, 16),
        (32, 96),
    ] {
        for walkers in [None, Some(1), Some(2), Some(4)] {
            let t = coop_decode_tiles(d, dv, true, caps, walkers).unwrap_or_else(|| {
                panic!("no cooperative decode tiles for d={d} dv={dv} {walkers:?}")
            });
            assert!(t.workgroup_bytes() <= 48 * 1024);
            // Paged or not; the variants with a pool over several buffers;
            // waits workgroup-wide (wgpu's own SPIR-V) or not.
            for (paged, variants, scratch) in [
                (false, false, true),
                (true, false, false),
                (true, true, true),
            ] {
                let flag = |x: bool| if x { 1.0 } else { 0.0 };
                let constants: Vec<(&str, f64)> = t
                    .overrides(paged)
                    .into_iter()
                    .chain(score_variant_overrides(variants, variants))
                    .chain([
                        ("SKIPS", flag(variants)),
                        ("SUBGROUP_SCRATCH", flag(scratch)),
                    ])
                    .collect();
                let values: naga::back::PipelineConstants =
                    constants.iter().map(|&(n, v)| (n.to_string(), v)).collect();
                naga::back::pipeline_constants::process_overrides(
                    &module,
                    &info,
                    Some((naga::ShaderStage::Compute, "main")),
                    &values,
                )
                .unwrap_or_else(|e| panic!("decode/coop.wgsl {t:?} paged={paged}: {e:?}"));
                flashport_core::gpu::spirv::compile(&text, &constants, true, true)
                    .unwrap_or_else(|e| panic!("decode/coop.wgsl {t:?} to SPIR-V: {e}"));
                specialised += 1;
            }
        }
    }
    assert_eq!(specialised, 72);
    // Shapes and adapters it does not take.
    for (d, dv) in [(8, 64), (64, 24), (COOP_MAX_HEAD_DIM + 16, 64), (100, 100)] {
        assert_eq!(
            coop_decode_tiles(d, dv, true, caps, None),
            None,
            "d={d} dv={dv}"
        );
    }
    assert_eq!(coop_decode_tiles(128, 128, false, caps, None), None);
    let no_coop = DecodeCaps {
        coop: false,
        ..caps
    };
    assert_eq!(coop_decode_tiles(128, 128, true, no_coop, None), None);
}
