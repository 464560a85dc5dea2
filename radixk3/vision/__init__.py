"""Kimi K3's vision side (K2.5's MoonViT3d tower and `patchmergerv2` projector), beside the text model.

- `config`: the checkpoint's nested `vision_config`, parsed strictly (`VisionConfig`).
- `image_processor`: an image -> pixel patches + grid (t, h, w) + content hash (`ProcessedImage`), as transformers'
  `Kimi_K25ImageProcessor` resizes, pads, normalises and patchifies.
- `tower`, `projector`, `packed_attention`: the encoder (`VisionEncoder`): packed images in, one projected
  embedding per `<|media_pad|>` token out.
- `weights`: the published tensor names (`vision_tower.*`, `mm_projector.*`), loading and random init.
- `prompt`: the `<|kimi_image_placeholder|>` expansion into the media markers and pad ids.
"""
